"""The helper package of this repo's commands (train.py, sample.py, eval_hellaswag.py): run
plumbing in training/, fast ops in kernels/. The wheel ships kernels/ (with fused_loss/) as a
library; training/ imports the clone's model.py and runs from the clone. One package under the
project's own name, so that no folder of this repo shadows an installed package (a top-level
`kernels/` hid Hugging Face's `kernels`, which transformers >= 5.25 imports). Nothing here runs
on import.
"""
