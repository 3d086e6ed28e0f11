"""Shared fixtures: a tiny token dataset and the settings of a tiny, fast training run."""

import importlib.util
import os

import numpy as np
import pytest
import torch

# Without a GPU, run the real Triton kernels in Triton's CPU interpreter. Set before anything
# imports fused_loss or kernels: triton.jit reads it when the kernels are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_fixes_for_older_versions():
    """What the interpreted tests need from older Triton and torch, as newer ones do it:
    - Triton 3.6's interpreter (torch 2.11's) holds a scalar as a 1-element array and makes it
      an index with int(array), which numpy 2.4 refuses for an array of one dimension, so a
      kernel's `range` over a program id or a runtime size fails; 3.7 squeezes the array first;
    - torch 2.11's wrap_triton refuses the interpreter's kernels; 2.13 returns them as they are
      (eager mode runs them). Before the kernel modules import it."""
    import torch.library
    import triton
    from triton.runtime import interpreter

    inherited_wrap = torch.library.wrap_triton

    def wrap_triton(kernel):
        return (
            kernel
            if isinstance(kernel, interpreter.InterpretedFunction)
            else inherited_wrap(kernel)
        )

    torch.library.wrap_triton = wrap_triton
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7):
        return
    inherited_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        inherited_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_fixes_for_older_versions()


from data.shards import write_shard  # noqa: E402
from gpt2_fused.training.compile_cache import use_keyed_cache  # noqa: E402
from gpt2_fused.training.jsonl import read_jsonl  # noqa: E402

# the compiled tests' graphs come from this checkout's custom ops, not a cached older version's
# (the tests' train.py subprocesses inherit the folder)
use_keyed_cache()

# what a finished run adds to its out_dir beside checkpoints and log.jsonl (with matplotlib only)
LOSS_PNG = ["loss.png"] if importlib.util.find_spec("matplotlib") else []

# A 2-layer, 32-wide GPT over the first 512 token ids (tiny_data uses no others), micro-batches of
# 4 x 32 tokens, 2 micro-steps per optimizer step: ~42K parameters, a few ms per step on a CPU.
# The torch loss: under TRITON_INTERPRET=1 the fused one runs in the (slow) Triton interpreter, and
# tests/test_fused_loss.py covers it.
TINY = [
    "--vocab_size=512",
    "--padded_vocab_size=512",
    "--loss_impl='torch'",
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=4",
    "--total_batch_size=256",
    "--warmup_steps=2",
    "--learning_rate=3e-3",
    "--val_tokens=512",
    "--device=cpu",
    "--dtype=float32",
    "--compile=False",
]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A dataset directory in the data/ layout: one val shard and two train shards.

    Tokens follow a noisy first-order chain over 64 ids below 512, so a model's loss falls fast
    and far from ln(512) = 6.2, and every step sees different data.
    """
    d = tmp_path_factory.mktemp("tiny_data")
    rng = np.random.default_rng(0)
    vocab = rng.choice(512, size=64, replace=False)
    nxt = rng.integers(0, 64, size=64)

    def stream(n):
        s = np.empty(n, dtype=np.int64)
        s[0] = 0
        for i in range(1, n):
            s[i] = nxt[s[i - 1]] if rng.random() < 0.8 else rng.integers(0, 64)
        return vocab[s]

    write_shard(d / "tiny_val_000000.bin", stream(4096))
    write_shard(d / "tiny_train_000001.bin", stream(20000))
    write_shard(d / "tiny_train_000002.bin", stream(20000))
    return d


@pytest.fixture
def tiny_args(tiny_data):
    """train.py arguments for a tiny run on tiny_data (add out_dir, max_steps, ...)."""
    return [*TINY, f"--dataset={tiny_data}"]


def read_log(out_dir):
    """(train loss by step, val loss by step) from out_dir/log.jsonl; a step logged twice fails."""
    losses, vals = {}, {}
    for rec in read_jsonl(os.path.join(out_dir, "log.jsonl")):
        d = vals if "val_loss" in rec else losses
        assert rec["step"] not in d, f"step {rec['step']} was logged twice"
        d[rec["step"]] = rec.get("val_loss", rec.get("loss"))
    return losses, vals


def read_norms(out_dir):
    """{step: grad norm before clipping} from out_dir/log.jsonl: the one logged figure that
    shows grads off by a constant factor (the clip and AdamW's scale-invariance hide it from the
    losses)."""
    recs = read_jsonl(os.path.join(out_dir, "log.jsonl"))
    return {r["step"]: r["grad_norm"] for r in recs if "grad_norm" in r}
