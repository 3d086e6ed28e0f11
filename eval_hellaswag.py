"""HellaSwag acc_norm of a checkpoint or of GPT-2 itself (the evaluation is data/hellaswag.py's).

python -m data.hellaswag download                 # once, the validation split
python eval_hellaswag.py --ckpt out/              # the newest checkpoint of a run
python eval_hellaswag.py --hf-dir ~/gpt2          # GPT-2 itself, from a local HF directory
torchrun --standalone --nproc_per_node=8 eval_hellaswag.py --ckpt out/
"""

import torch

from data import hellaswag
from gpt2_fused.training import cli, distributed, model_io
from gpt2_fused.training.errors import UsageError, run_main
from gpt2_fused.training.hardware import resolve_dtype


def parse_args(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="checkpoint file, or an out_dir (its newest ckpt_*.pt)")
    src.add_argument("--hf-dir", help="local HF GPT-2 directory (config.json + weights)")
    p.add_argument(
        "--data", default=str(hellaswag.DEFAULT_PATH), help="HellaSwag jsonl (default: %(default)s)"
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N examples")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="autocast dtype; auto: bfloat16 on a GPU that has it, float16 on an older one",
    )
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    return args


def main(argv=None):
    """The scores (hellaswag.evaluate's dict); rank 0 prints them on one line."""
    args = parse_args(argv)
    try:
        procs = distributed.setup(args.device)
    except ValueError as e:
        raise UsageError(f"--device: {e}") from None
    device, finished = procs.device, False
    try:
        hellaswag.load_tokenized(args.data)  # a missing or bad file fails before the model loads
        dtype = resolve_dtype(args.dtype, device)
        # fp32 weights with autocast, as in training: the number to compare with the val loss's
        model = model_io.load_model(args.ckpt, args.hf_dir, device, torch.float32)
        res = hellaswag.evaluate(
            model,
            args.data,
            device,
            procs.rank,
            procs.world_size,
            limit=args.limit,
            autocast_dtype=None if dtype == torch.float32 else dtype,
            progress=procs.master,
        )
        if procs.master:
            n, world = res["n"], procs.world_size
            print(
                f"hellaswag acc_norm {res['acc_norm']:.4f} ({round(res['acc_norm'] * n)}/{n}) | "
                f"acc {res['acc']:.4f} ({round(res['acc'] * n)}/{n}) | {dtype} on {device}"
                f"{f' x {world}' if world > 1 else ''}",
                flush=True,
            )
        finished = True
        return res
    finally:
        distributed.teardown(procs, finished)


if __name__ == "__main__":
    run_main(main, model_io.USER_ERRORS | {ConnectionError: "error"})
    distributed.exit_if_launched()

# Expected output (GPT-2 124M imported with --hf-dir, all 10,042 examples; llm.c reports
# acc_norm 0.2955 and acc 0.2859 for these weights in fp32):
#   hellaswag acc_norm 0.2955 (2967/10042) | acc 0.2859 (2871/10042) | torch.float32 on cuda
