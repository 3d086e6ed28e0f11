"""Linear + cross-entropy fwd+bwd: our kernel vs torch eager, torch.compile, Liger and CCE.

    python -m bench.bench_fused_loss [--shapes 124M,1558M,256k] [--out DIR] [--variants]
        [--methods torch.compile,ours] [--set per_sm=3,single_read=False] [--repeats 5]

For each shape: x (N, D) ~ N(0, 1) bf16, w (V, D) bf16 with logits of std ~2, targets uniform over
the vocab with 5 % ignored (-100). Every method gets the same tensors. Reports fwd+bwd and forward
times (median of CUDA-event timings, synchronised after each call so host latency counts; "GPU ms"
is fwd+bwd with the host's latency hidden behind a queued GPU sleep), peak memory allocated above
the inputs during one fwd+bwd (grads included; buffers a method keeps between calls are counted
because the baseline is taken before its first call), and loss/dx/dw errors against an fp32 (no
TF32) reference.
--repeats N: per shape every method is set up once (first call, errors, peak memory), then timed
N times, the methods taking turns within each repeat so that the machine's drift (clocks, heat)
hits them alike. A row gives each time's median over the repeats, the repeats' values
(*_each), and wall_vs_compile / gpu_vs_compile: the median over repeats of its fwd+bwd (GPU) ms
over torch.compile's in the same repeat, at the same weight dtype. The bf16-weight rows (with the
masked vocab) take turns among themselves, then the fp32-master-weight rows among theirs, so each
ratio's pair is timed side by side; the --variants rows are timed once each.
Liger and CCE are optional: if they do not import, their rows say so.
"""

import argparse
import json
import os
import statistics
import time

import torch

import fused_loss.linear_cross_entropy as fl
from bench.common import (
    LOSS_SHAPES,
    VARIANTS,
    FwdBwd,
    MiB,
    make_inputs,
    master_weight,
    methods,
    timed,
    variant,
)
from fused_loss import fused_linear_cross_entropy
from gpt2_fused.training import model_io


def real_inputs(ckpt, tokens, N):
    """Final-LayerNorm outputs (N, D) bf16 of a checkpoint of ours on the first N+1 tokens of a
    shard, its tied classifier (bf16) and the next-token targets: a trained model's softmax."""
    from data.shards import read_shard

    model, _ = model_io.from_checkpoint(ckpt, map_location="cuda")
    T = model.config.block_size
    toks = torch.from_numpy(read_shard(tokens)[: N + 1].astype("int64")).cuda()
    idx, tgt = toks[:N].view(-1, T), toks[1 : N + 1]
    tr = model.transformer
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        h = tr.wte(idx) + tr.wpe(torch.arange(T, device="cuda"))
        for block in tr.h:
            h = block(h)
        x = tr.ln_f(h).reshape(N, -1).bfloat16()
    return x, tr.wte.weight.detach().bfloat16().contiguous(), tgt, model.config.vocab_size


def fp32_reference(x, w, t):
    torch.backends.cuda.matmul.allow_tf32 = False
    xr = x.float().requires_grad_()
    wr = w.float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(xr @ wr.T, t, ignore_index=-100)
    loss.backward()
    return loss.detach(), xr.grad, wr.grad


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def prepare(fn, x, w, t, ref):
    """fn's first call (compilation, caches), its errors against ref and its peak memory during
    one fwd+bwd: (timers, res), timers for time_once(). The grads are dropped after, so methods
    prepared side by side hold none while the others are timed."""
    fwd_bwd = FwdBwd(fn, x, w, t)
    xg, wg = fwd_bwd.x, fwd_bwd.w

    def fwd():
        with torch.enable_grad():
            return fn(xg, wg, t)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    xg.grad = wg.grad = None
    loss = fn(xg, wg, t)  # first call: compilation, caches
    loss.backward()
    errs = dict(
        err_loss=rel(loss.detach(), ref[0]),
        err_dx=rel(xg.grad, ref[1]),
        err_dw=rel(wg.grad, ref[2]),
    )
    xg.grad = wg.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MiB
    fwd_bwd.clear()
    return (fwd_bwd, fwd), dict(peak_mib=peak, **errs)


def time_once(timers, reps):
    """One repeat of a prepared method: wall fwd+bwd (host latency counted), forward, GPU fwd+bwd
    (host hidden), each the median of reps calls; its grads dropped after, raise or not."""
    fwd_bwd, fwd = timers
    try:
        res = dict(fwd_bwd_ms=timed(fwd_bwd, reps), fwd_ms=timed(fwd, reps))
        res["gpu_ms"] = timed(fwd_bwd, reps, hide_host=True)
        return res
    finally:
        fwd_bwd.clear()


def measure(fn, x, w, t, ref, reps):
    """One method prepared and timed once (the --variants rows)."""
    timers, res = prepare(fn, x, w, t, ref)
    ms = time_once(timers, reps)
    return dict(fwd_bwd_ms=ms["fwd_bwd_ms"], fwd_ms=ms["fwd_ms"], **res, gpu_ms=ms["gpu_ms"])


def try_prepare(fn, x, w, t, ref):
    """prepare()'s result, or an error row (fn a string: the method did not import)."""
    if isinstance(fn, str):
        return dict(error=fn)
    try:
        out = prepare(fn, x, w, t, ref)
    except Exception as e:
        out = dict(error=repr(e)[:300])
    torch.cuda.empty_cache()
    return out


TIMES = ("fwd_bwd_ms", "fwd_ms", "gpu_ms")


def interleaved(prepared, repeats, time_one, base, label=""):
    """Rows of the prepared methods ({name: try_prepare()'s result}), in their order: repeats
    rounds that each time every method once in turn, so drift between rounds hits all alike.
    Per time, the median over the rounds and each round's value; wall_vs_compile and
    gpu_vs_compile: the median over rounds of the ratio to method `base` in the same round. A
    method that raises gets its error row and drops out; the others go on."""
    done = {name: p for name, p in prepared.items() if isinstance(p, dict)}  # error rows
    each = {name: [] for name in prepared if name not in done}
    for r in range(repeats):
        for name, runs in each.items():
            if name in done:
                continue
            try:
                runs.append(time_one(prepared[name][0]))
            except Exception as e:
                done[name] = dict(error=repr(e)[:300])
                if repeats > 1:
                    done[name]["failed_repeat"] = r
            torch.cuda.empty_cache()
        if repeats > 1:
            ms = ", ".join(
                f"{n} {v[r]['fwd_bwd_ms']:.2f}/{v[r]['gpu_ms']:.2f}"
                for n, v in each.items()
                if n not in done
            )
            print(f"{label} repeat {r + 1}/{repeats} (wall/GPU ms): {ms}", flush=True)
    rows = {}
    for name, p in prepared.items():
        if name in done:
            rows[name] = done[name]
            continue
        runs = {k: [run[k] for run in each[name]] for k in TIMES}
        med = {k: statistics.median(v) for k, v in runs.items()}
        row = dict(fwd_bwd_ms=med["fwd_bwd_ms"], fwd_ms=med["fwd_ms"], **p[1], gpu_ms=med["gpu_ms"])
        row.update({f"{k}_each": v for k, v in runs.items()}, repeats=repeats)
        if base in each and base not in done:
            for key, k in (("wall_vs_compile", "fwd_bwd_ms"), ("gpu_vs_compile", "gpu_ms")):
                pairs = zip(runs[k], (run[k] for run in each[base]), strict=True)
                row[key] = statistics.median(a / b for a, b in pairs)
        rows[name] = row
    return rows


def kernel_breakdown(x, w, t, vocab):
    """CUDA time per kernel name for one fwd+bwd of ours (torch profiler)."""
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    fused_linear_cross_entropy(xg, wg, t, vocab_size=vocab).backward()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        xg.grad = wg.grad = None
        fused_linear_cross_entropy(xg, wg, t, vocab_size=vocab).backward()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us > 0:
            rows[ev.key[:60]] = (us / 1000.0, ev.count)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][0])[:12])


def run_variant(name, x, w, t, ref, reps):
    with variant(name) as v:
        if v.get("master"):
            return measure(master_weight(fused_linear_cross_entropy), x, w.float(), t, ref, reps)
        return measure(fused_linear_cross_entropy, x, w, t, ref, reps)


def parse_set(text, config):
    """--set "k=v,k=v" as {k: v}, each v parsed as the type of config[k] (bools: True/False)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in config:
            raise SystemExit(f"--set: {item!r} is not k=v with k one of {sorted(config)}")
        kind = type(config[key])
        if kind is bool:
            if value not in ("True", "False"):
                raise SystemExit(f"--set: {key} takes True or False, not {value!r}")
            out[key] = value == "True"
        elif kind is int:
            out[key] = int(value)
        else:  # strings, and options such as single_read="auto" that also take True/False
            out[key] = {"True": True, "False": False}.get(value, value)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="124M,1558M,256k")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=10, help="calls per timing (its median)")
    ap.add_argument(
        "--repeats", type=int, default=1, help="timings of each method, interleaved; median"
    )
    ap.add_argument("--variants", action="store_true", help="also time tile/buffer variants")
    ap.add_argument("--methods", default="", help="comma list to run (default: all)")
    ap.add_argument(
        "--checkpoint", help="also bench on this checkpoint's hidden states (124M-real)"
    )
    ap.add_argument("--tokens", help="token shard for --checkpoint (e.g. the val shard)")
    ap.add_argument(
        "--set",
        default="",
        help="LAUNCH['cuda'] entries (fused_loss/linear_cross_entropy.py) for the run: k=v,k=v",
    )
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    with fl.launch_settings(**parse_set(args.set, fl.LAUNCH["cuda"])):
        run(args)


def run(args):
    """The whole benchmark of main()'s arguments, under their --set launch."""
    props = torch.cuda.get_device_properties(0)
    import triton

    info = dict(
        configs=dict(fl.LAUNCH["cuda"]),
        gpu=props.name,
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d"),
    )
    print(info, flush=True)
    results = dict(info=info, rows=[], breakdown={})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_fused_loss.json")

    def record(shape, name, res):
        row = dict(shape=shape, method=name, **res)
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    meths = methods()
    if args.methods:
        meths = {k: v for k, v in meths.items() if k in args.methods.split(",")}
    shapes = [s for s in args.shapes.split(",") if s] + (["124M-real"] if args.checkpoint else [])

    def time_one(timers):
        return time_once(timers, args.reps)

    for shape in shapes:
        if shape == "124M-real":
            x, w, t, vocab = real_inputs(args.checkpoint, args.tokens, LOSS_SHAPES["124M"][0])
            N, D, V = x.shape[0], x.shape[1], w.shape[0]
            p = torch.softmax((x[:4096].float() @ w[:vocab].float().T), dim=-1)
            record(
                shape,
                "softmax stats",
                dict(
                    mean_max_prob=p.max(-1).values.mean().item(),
                    frac_above_2e12=(p > 2**-12).float().mean().item(),
                ),
            )
            del p
        else:
            N, D, V = LOSS_SHAPES[shape]
            x, w, t = make_inputs(N, D, V)
        ref = fp32_reference(x, w, t)
        grads_mib = (x.numel() + w.numel()) * 2 / MiB
        record(shape, "lower bound (grads)", dict(peak_mib=grads_mib))
        # bf16 weight: meths and the masked row, interleaved; compared with torch.compile's
        prepared = {name: try_prepare(fn, x, w, t, ref) for name, fn in meths.items()}
        if V == 50304:  # the padded GPT-2 vocab with the 47 padded columns masked
            masked = lambda x, w, t: fused_linear_cross_entropy(x, w, t, vocab_size=50257)  # noqa
            t_real = t.clamp(max=50256)
            ref_m = fp32_reference(x, w[:50257], t_real)
            dw_ref = torch.cat([ref_m[2], ref_m[2].new_zeros(V - 50257, D)])  # padded rows: 0
            ref_m = (ref_m[0], ref_m[1], dw_ref)
            prepared["ours (vocab 50257 masked)"] = try_prepare(masked, x, w, t_real, ref_m)
            del ref_m, dw_ref
        group = interleaved(prepared, args.repeats, time_one, "torch.compile", shape)
        for name, res in group.items():
            record(shape, name, res)
        del prepared
        torch.cuda.empty_cache()
        if shape in ("124M", "1558M"):  # the trainer's case: fp32 master weight, fp32 dw
            w32 = w.float()
            prepared = {}
            for name in ("torch.compile", "ours"):
                if name not in meths or isinstance(meths[name], str):  # --methods left it out
                    continue
                fn = master_weight(meths[name])  # torch.compile recompiles for the fp32 weight
                prepared[f"{name} (fp32 master w)"] = try_prepare(fn, x, w32, t, ref)
            base = "torch.compile (fp32 master w)"
            group = interleaved(prepared, args.repeats, time_one, base, f"{shape} fp32 master w")
            for name, res in group.items():
                record(shape, name, res)
            del w32, prepared
            torch.cuda.empty_cache()
        if args.variants and shape == "124M":
            for vname in VARIANTS:
                try:
                    record(shape, f"ours[{vname}]", run_variant(vname, x, w, t, ref, args.reps))
                except Exception as e:
                    record(shape, f"ours[{vname}]", dict(error=repr(e)[:300]))
                torch.cuda.empty_cache()
        try:
            results["breakdown"][shape] = kernel_breakdown(x, w, t, V)
        except Exception as e:
            results["breakdown"][shape] = repr(e)[:300]
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        del x, w, t, ref
        torch.cuda.empty_cache()

    print("\nper-kernel CUDA ms (one fwd+bwd of ours):")
    for shape, rows in results["breakdown"].items():
        print(shape, rows if isinstance(rows, str) else "")
        if not isinstance(rows, str):
            for k, (ms, n) in rows.items():
                print(f"  {ms:8.2f} ms  x{n:<4d} {k}")
    cols = "fwd+bwd ms | GPU ms | fwd ms | peak MiB | err loss | err dx | err dw"
    print(
        f"\nmedians of {args.repeats} interleaved repeat(s) (ours[...] variants: one); "
        "/ compile: median per-repeat ratio to torch.compile at the same weight dtype"
    )
    print(f"| shape | method | {cols} | wall / compile | GPU / compile |")
    print("|---" * 11 + "|")
    for r in results["rows"]:
        if "error" in r:
            print(f"| {r['shape']} | {r['method']} | error: {r['error'][:80]} |")
            continue

        def f(k, fmt, r=r):
            return format(r[k], fmt) if k in r else ""

        print(
            f"| {r['shape']} | {r['method']} | {f('fwd_bwd_ms', '.2f')} | {f('gpu_ms', '.2f')} | "
            f"{f('fwd_ms', '.2f')} | "
            f"{f('peak_mib', '.0f')} | {f('err_loss', '.1e')} | {f('err_dx', '.1e')} | "
            f"{f('err_dw', '.1e')} | {f('wall_vs_compile', '.3f')} | {f('gpu_vs_compile', '.3f')} |"
        )


if __name__ == "__main__":
    main()
