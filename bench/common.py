"""What several benchmarks share: the loss benchmarks' shapes and inputs, the fused loss's methods
and launch variants, and the timers (CUDA events, CUDA graphs). Importing it touches no GPU.
"""

import argparse
import contextlib
import json
import os
import statistics

import torch

from fused_loss import fused_linear_cross_entropy, linear_cross_entropy_reference
from fused_loss import linear_cross_entropy as fl

# (N, D, V) of the classifier's fwd+bwd: tokens of a micro-batch, width, padded vocab
LOSS_SHAPES = {
    "124M": (32768, 768, 50304),
    "1558M": (16384, 1600, 50304),
    "256k": (8192, 2304, 256000),
}
MiB = 2**20


def make_inputs(N, D, V, seed=0):
    """x (N, D) ~ N(0, 1) bf16, w (V, D) bf16 with logits of std ~2, targets uniform over the
    vocab with 5 % ignored (-100); on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) * (2.0 / D**0.5)).bfloat16()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    t[torch.rand(N, device="cuda", generator=g) < 0.05] = -100
    return x, w, t


def master_weight(fn):
    """fn run as the trainer runs it: an fp32 weight under bf16 autocast (x is bf16 already)."""

    def run(x, w, t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(x, w, t)

    return run


class FwdBwd:
    """One fwd+bwd of fn(x, w, t) per call, on leaf copies .x, .w, with fresh gradients each
    call (as every script here times it); clear() drops the last call's gradients."""

    def __init__(self, fn, x, w, t):
        self.fn, self.t = fn, t
        self.x, self.w = x.detach().requires_grad_(), w.detach().requires_grad_()

    def clear(self):
        self.x.grad = self.w.grad = None

    def __call__(self):
        self.clear()
        self.fn(self.x, self.w, self.t).backward()


def methods():
    """The loss implementations compared: name -> fn(x, w, t), or the import error of an
    optional one (Liger, CCE) as a string, which its row then reports instead of failing."""
    out = {
        "torch eager": linear_cross_entropy_reference,
        "torch.compile": torch.compile(linear_cross_entropy_reference),
        "ours": fused_linear_cross_entropy,
    }
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        out["liger"] = lambda x, w, t: liger(w, x, t)
    except Exception as e:  # not installed: report, don't fail
        out["liger"] = repr(e)
    try:
        from cut_cross_entropy import linear_cross_entropy

        out["cce"] = lambda x, w, t: linear_cross_entropy(x, w, t, ignore_index=-100)
    except Exception as e:
        out["cce"] = repr(e)
    return out


# Variants of ours, timed at the 124M shape: memory budget (chunk size) and the row kernels'
# launch (the arguments of fl.launch_settings: extra_bytes, LAUNCH["cuda"] entries).
VARIANTS = {
    "w16_sm2": dict(row=dict(per_sm=2, num_warps=16)),
    "single_read": dict(row=dict(single_read=True)),
    "two_reads": dict(row=dict(single_read=False)),
    "extra640": dict(extra=640 * MiB),
    # the trainer's case: fp32 master weight under autocast (at 124M 5 chunks of 6554 rows)
    "master_two_reads": dict(row=dict(single_read=False), master=True),
}


@contextlib.contextmanager
def variant(name):
    """The settings of VARIANTS[name], restored after; yields the variant."""
    v = VARIANTS[name]
    with fl.launch_settings(extra_bytes=v.get("extra"), **v.get("row", {})):
        yield v


def timed(fn, reps, warmup=2, hide_host=False):
    """Median ms of fn between CUDA events, synchronising after each call, so a call's host
    latency before its first kernel counts. hide_host: queue ~10 ms of GPU sleep first, so the
    host has queued the call's kernels before the start event fires: GPU time alone."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hide_host:
            torch.cuda._sleep(20_000_000)  # cycles: ~10 ms at the H200's ~2 GHz
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def events(fn, n=20):
    """ms per call of fn over n calls queued back to back behind a GPU sleep (the host's latency
    hidden), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n


def graph_us(fn, copies, repeats=5):
    """µs per call of fn(i) for i over the weight copies, in one CUDA graph; median of rounds."""
    for i in range(len(copies)):
        fn(i)  # compile the Triton kernels and warm cuBLAS before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(len(copies)):
            fn(i)
    rounds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / len(copies))
    return statistics.median(rounds)


def write_json(folder, name, obj):
    """obj as indented JSON in folder/name (the folder made if need be); nothing if folder is
    None (a benchmark run without --out)."""
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        json.dump(obj, f, indent=1)


def xl_shape_args(doc, halves=False):
    """--tokens, --width (1558M:16's 16 x 1024 tokens, n_embd 1600) and --out of a benchmark
    whose module docstring is doc; with halves, --half (a block's "mlp" or "attn" half)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--out", default=None)
    if halves:
        ap.add_argument("--half", choices=("mlp", "attn"), default="mlp")
    return ap.parse_args()


def for_benchmarks(train, on_step=None):
    """Ready the train module for a timed run in this process: its checkpoints become empty
    files (the final one is not what is measured; 1558M's is 18.7 GB to write), and on_step()
    (a profiler's step), if given, runs each time the loop logs an optimizer step."""

    def no_save(obj, out_dir, step, keep_last):
        path = os.path.join(out_dir, "no_checkpoint_in_benchmarks")
        open(path, "w").close()
        return path

    train.save_checkpoint = no_save
    if on_step is not None:
        from gpt2_fused.training import runlog

        fmt = runlog.format_step

        def stepping(rec, max_steps):
            on_step()
            return fmt(rec, max_steps)

        runlog.format_step = stepping
