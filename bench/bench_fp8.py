"""FP8 variants of GPT-2's training forward+backward against bf16, compiled, on one GPU.

    python -m bench.bench_fp8 [--preset gpt2-xl] [--n_layer 6] [--batch 16]
        [--variants bf16,plain,tensorwise,...] [--steps 15] [--profile tensorwise,bf16]
        [--out DIR]

Each variant is a fresh process: a GPT at the preset's width with --n_layer blocks, fp32 master
weights, converted as the variant says (VARIANTS), compiled under train.py's compiler settings,
then forward (fused loss) + backward under bf16 autocast on uniform random tokens, B x 1024.
No optimizer step: every variant but plain keeps the same AdamW. Reported: median GPU ms per
step (CUDA events, after 3 warm-up steps), ms per block against bf16's (the difference, over
n_layer: what each block of a deeper model gains), peak memory and the first loss (the variants
agreed to 1e-3 at both widths). The variants compile at once, each in its process,
and wait for each other; then they time one at a time (a lock), with the host otherwise idle.
--profile variants also print their top CUDA kernels over 3 profiled steps. Writes
DIR/bench_fp8.json.

The variants are what gpt2_fused/training/fp8.py could do with torchao's public float8 API, to
choose among them; train.py's --fp8 runs "tensorwise" and "rowwise" as defined here.
"""

import argparse
import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time

import torch

from gpt2_fused.training.compile_cache import use_keyed_cache
from gpt2_fused.training.fp8 import BLOCK_LINEARS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# name -> how to build it. recipe: torchao's float8 recipe (None: no FP8); linears: which of
# each block's Linears to convert; auto: torchao's size filter on top; fast_accum: the backward
# GEMMs too accumulate in FP8's fast mode (torchao: the forward only); gw_bf16: dW = dy^T x in
# bf16 (no FP8 casts of x^T and dy^T); plain: every fast path off (bench/throughput.py's plain)
VARIANTS = {
    "bf16": dict(),
    "plain": dict(plain=True),
    "tensorwise": dict(recipe="tensorwise"),
    "rowwise": dict(recipe="rowwise"),
    "tensorwise_fast_accum": dict(recipe="tensorwise", fast_accum=True),
    "tensorwise_gw_bf16": dict(recipe="tensorwise", gw_bf16=True),
    "tensorwise_mlp": dict(recipe="tensorwise", linears=("mlp.c_fc", "mlp.c_proj")),
    "tensorwise_no_qkv": dict(
        recipe="tensorwise", linears=("attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ),
    "tensorwise_auto": dict(recipe="tensorwise", auto=True),
    "tensorwise_fc": dict(recipe="tensorwise", linears=("mlp.c_fc",)),
}
PLAIN = dict(loss_impl="torch", mlp_impl="torch", attn_impl="torch", low_precision_residual=False)


def float8_config(v):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import CastConfig, Float8GemmConfig, ScalingType

    config = Float8LinearConfig.from_recipe_name(v["recipe"])
    if v.get("fast_accum"):
        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(
            config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast
        )
    if v.get("gw_bf16"):
        # a disabled cast keeps the dtype of the other GEMM's cast of the same tensor (torchao
        # asserts they agree): e5m2 for dy in tensorwise
        off = dict(scaling_type=ScalingType.DISABLED)
        dy_dtype = config.cast_config_grad_output.target_dtype
        config = dataclasses.replace(
            config,
            cast_config_input_for_grad_weight=CastConfig(**off),
            cast_config_grad_output_for_grad_weight=CastConfig(**off, target_dtype=dy_dtype),
        )
    return config


def _attention_fp8_proj(self, x, cache=None, layer=0, residual=None):
    """CausalSelfAttention.forward with the attention op for c_attn (bf16) and c_proj through its
    module (a Float8Linear): the no_qkv variant."""
    from gpt2_fused.kernels import attention

    y = attention.attention_fast(x, self.c_attn.weight, self.c_attn.bias, self.n_head)
    if y is None:
        y = self.attend(self.c_attn(x))
    out = self.c_proj(y)
    return out if residual is None else residual + out


def convert(model, v):
    """Convert model's block Linears as variant v says; the converted names."""
    import types

    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe  # private in 0.18

    names = v.get("linears", BLOCK_LINEARS)
    wanted = {f"transformer.h.{i}.{n}" for i in range(len(model.transformer.h)) for n in names}
    auto = _auto_filter_for_recipe(v["recipe"], []) if v.get("auto") else None
    converted = []

    def swap(module, fqn):
        if fqn in wanted and (auto is None or auto(module, fqn)):
            converted.append(fqn)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=swap, config=float8_config(v))
    for i, block in enumerate(model.transformer.h):
        done = {n for n in names if f"transformer.h.{i}.{n}" in converted}
        if done & {"mlp.c_fc", "mlp.c_proj"}:
            block.mlp.use_cublaslt = False
        if "attn.c_attn" in done:
            block.attn.use_fast = False
        elif "attn.c_proj" in done and block.attn.use_fast:
            block.attn.forward = types.MethodType(_attention_fp8_proj, block.attn)
    return converted


def child(args, name):
    """One variant, in this process: its result as a dict."""
    from gpt2_fused.training.compile_settings import compiler_settings
    from gpt2_fused.training.config import load_config
    from model import GPT, GPTConfig

    v = VARIANTS[name]
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = load_config([f"--model='{args.preset}'", f"--batch_size={args.batch}"])  # not "auto"
    overrides = dict(n_layer=args.n_layer, **(PLAIN if v.get("plain") else {}))
    for item in filter(None, args.sizes.split(",")):  # a CPU rehearsal's tiny sizes
        key, value = item.split("=")
        overrides[key] = int(value)
    mcfg = GPTConfig.from_preset(args.preset, **overrides)
    dev = torch.device(args.device)
    with dev:
        model = GPT(mcfg)
    converted = convert(model, v) if v.get("recipe") else []
    B, T = args.batch, mcfg.block_size
    g = torch.Generator(device=dev).manual_seed(1)
    idx = torch.randint(0, mcfg.vocab_size, (B, T), device=dev, generator=g)
    tgt = torch.randint(0, mcfg.vocab_size, (B, T), device=dev, generator=g)
    params = list(model.parameters())

    def step():
        with torch.autocast(dev.type, torch.bfloat16):
            loss = compiled(idx, tgt)
        loss.backward()
        for p in params:
            p.grad = None
        return loss.detach()

    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t0 = time.time()
    with compiler_settings(cfg):
        compiled = torch.compile(model) if cuda else model  # the CPU's rehearsal runs eager
        first = step().item()  # compiles
        step()
        compile_s = time.time() - t0
        sync()
        open(f"{args.lock}.ready.{name}", "w").close()
        while not os.path.exists(args.lock + ".go"):  # until every variant has compiled
            time.sleep(0.5)
        with open(args.lock, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the GPU to this process alone from here
            for _ in range(3):
                step()
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            ev = [Clock(cuda) for _ in range(args.steps + 1)]
            ev[0].record()
            for i in range(args.steps):
                step()
                ev[i + 1].record()
            sync()
            times = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(args.steps))
            res = dict(
                variant=name,
                converted=len(converted),
                ms=times[len(times) // 2],
                ms_min=times[0],
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                first_loss=first,
                compile_s=compile_s,
            )
            if name in args.profile.split(","):
                res["profile"] = profile(step)
    return res


class Clock:
    """A CUDA event, or on the CPU (a rehearsal of this script) the host's clock."""

    def __init__(self, cuda):
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None

    def record(self):
        if self.event is None:
            self.t = time.perf_counter()
        else:
            self.event.record()

    def elapsed_time(self, end):
        """ms from this record to end's."""
        if self.event is None:
            return 1000 * (end.t - self.t)
        return self.event.elapsed_time(end.event)


def profile(step, n=3):
    """Top kernels by CUDA time over n steps: [(ms per step, launches per step, name)]."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    cuda = torch.cuda.is_available()
    with prof_ctx(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()

    def us(e):  # the CPU's rehearsal: the ops' own CPU time instead
        return e.device_time_total if cuda else e.self_cpu_time_total

    events = [e for e in prof.key_averages() if us(e) > 0]
    rows = sorted(((us(e) / 1000 / n, e.count // n, e.key[:100]) for e in events), reverse=True)
    return dict(total_ms=sum(r[0] for r in rows), top=rows[:40])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2-xl")
    ap.add_argument("--n_layer", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--variants", default="bf16,plain,tensorwise,rowwise")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--profile", default="", help="variants to profile")
    ap.add_argument("--device", default="cuda", help="cpu: a rehearsal, eager")
    ap.add_argument("--sizes", default="", help="GPTConfig ints, as n_embd=64,block_size=32")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "out", "bench_fp8")))
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--lock", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_keyed_cache()  # not another version's custom-op graphs (children inherit it)
    if args.child:
        print("RESULT " + json.dumps(child(args, args.child)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {sorted(VARIANTS)}")
    lock = os.path.join(args.out, "gpu.lock")
    for path in [lock + ".go"] + [f"{lock}.ready.{n}" for n in names]:
        if os.path.exists(path):
            os.remove(path)
    base = [sys.executable, os.path.abspath(__file__), "--lock", lock]
    keys = ("preset", "n_layer", "batch", "steps", "profile", "device", "sizes")
    base += [f"--{k}={getattr(args, k)}" for k in keys]
    running, results = [], []
    for name in names:  # all at once: they compile together, then time one by one
        log = open(os.path.join(args.out, f"bench_fp8_{name}.log"), "w")
        proc = subprocess.Popen(base + ["--child", name], stdout=log, stderr=subprocess.STDOUT)
        running.append((name, proc, log))
    while running:
        time.sleep(1)
        ready = [os.path.exists(f"{lock}.ready.{n}") or p.poll() is not None for n, p, _ in running]
        if all(ready) and not os.path.exists(lock + ".go"):
            open(lock + ".go", "w").close()  # every variant compiled (or failed): time them
        for item in [r for r in running if r[1].poll() is not None]:
            name, proc, log = item
            running.remove(item)
            log.close()
            text = open(log.name).read()
            lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else dict(variant=name, error=text[-2000:])
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "profile"}), flush=True)
            with open(os.path.join(args.out, "bench_fp8.json"), "w") as f:
                json.dump(dict(args=vars(args), results=results), f, indent=1)
    report(results, args)


def report(results, args):
    order = args.variants.split(",")
    results = sorted(results, key=lambda r: order.index(r["variant"]))
    ok = {r["variant"]: r for r in results if "ms" in r}
    for r in results:
        if "error" in r:
            print(f"{r['variant']}: FAILED\n{r['error']}")
    for r in [r for r in results if "profile" in r]:
        p = r["profile"]
        print(f"\n{r['variant']}: all kernels {p['total_ms']:.2f} ms per step, top ones:")
        for ms, n, key in p["top"][:25]:
            print(f"  {ms:7.3f} ms {100 * ms / p['total_ms']:5.1f}% x{n:<4d} {key}")
    ref = ok.get("bf16")
    print(f"\n{args.preset} width, {args.n_layer} blocks, B {args.batch}, fwd+bwd only")
    print("| variant | Linears | ms/step | vs bf16 | block ms vs bf16 | GiB | loss0 | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in ok.items():
        ratio = f"{ref['ms'] / r['ms']:.3f}x" if ref else "-"
        dblock = f"{(r['ms'] - ref['ms']) / args.n_layer:+.3f}" if ref else "-"
        print(
            f"| {name} | {r['converted']} | {r['ms']:.2f} | {ratio} | {dblock} | "
            f"{r['peak_gib']:.2f} | {r['first_loss']:.4f} | {r['compile_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
