"""Does a compiled training step compute what eager mode computes? One batch, one model, variants.

    python -m bench.compile_check [--preset 1558M] [--batch 16] [--layers 48]
        [--variants eager:flash,compiled,compiled:torch,compiled:separate,compiled:flash]

Written for a 1558M run whose compiled first loss was 11.1171 against eager mode's 11.1460
(bench/RESULTS.md#compile); it traced that to Inductor's in-place buffers, which train.py now
turns off. Compiled variants use Inductor's defaults unless they say otherwise
("trainer": train.py's compile settings). The model (fp32 weights, bf16 autocast, as train.py
runs it) takes one step on one batch of random tokens: x and y are two views of one (B*T + 1)
buffer, as the data loader gives them. Each variant is a comma-free list of words after its
mode (eager or compiled), joined by ":":
  torch      the torch loss (materialised logits) instead of the fused one (loss_impl "fast")
  separate   x and y as two separate contiguous tensors instead of overlapping views
  flash      scaled_dot_product_attention limited to the flash kernel (default: cuDNN first)
  budget=F   torch._functorch.config.activation_memory_budget = F for this compile
  nosplit    torch._inductor.config.split_reductions = False for this compile
  nodrop     the model's Dropout(p=0) modules replaced by nn.Identity
  fp32       no autocast: fp32 matmuls (eager: the most exact result at hand)
  i.KEY=VAL  torch._inductor.config.KEY = VAL (a Python literal) for this compile
  trainer    train.py's compile settings (compile_settings.compiler_settings) for this compile
The reference is eager mode with the same loss. Printed per variant: the loss and its distance
to the reference, the gradient norm, and the parameter whose gradient is furthest from the
reference's (relative L2 error). Eager variants show how far a legitimate change (another
attention kernel) moves them: a compiled variant far beyond that computes something else.
"""

import argparse
import ast
import contextlib
import os
import time

import torch

from gpt2_fused.kernels.fast_paths import gpu_runs
from gpt2_fused.training.compile_cache import use_keyed_cache
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_loss(model, impl):
    """Switch the model's loss to `impl`: GPT's forward reads fused_loss, set at construction
    from config.loss_impl (model.py), so both change together."""
    model.config.loss_impl = impl
    model.fused_loss = impl == "fast" and (not torch.cuda.is_available() or gpu_runs("loss"))


def parse_variant(text):
    mode, *words = text.split(":")
    if mode not in ("eager", "compiled"):
        raise SystemExit(f"variant {text!r}: starts with eager or compiled")
    opts = dict(impl="fast", budget=None, inductor={})
    words_on = ("separate", "flash", "nodrop", "fp32", "trainer")
    opts.update({w: False for w in words_on})
    for w in words:
        if w == "torch":
            opts["impl"] = w
        elif w in opts:
            opts[w] = True
        elif w == "nosplit":  # shorthand for i.split_reductions=False
            opts["inductor"]["split_reductions"] = False
        elif w.startswith("i.") and "=" in w:
            key, val = w[2:].split("=", 1)
            opts["inductor"][key] = ast.literal_eval(val)
        elif w.startswith("budget="):
            opts["budget"] = float(w.split("=", 1)[1])
        else:
            raise SystemExit(f"variant {text!r}: unknown word {w!r}")
    return mode == "compiled", opts


def step(fn, model, x, y, autocast=True):
    """One forward + backward under bf16 autocast: (loss, {name: grad}), grads left in place."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = fn(x, y)
    loss.backward()
    return loss.detach().float(), {n: p.grad for n, p in model.named_parameters()}


def set_submodule(model, name, module):
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def grad_norm(grads):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1558M")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None, help="default: the preset's; 0 allowed")
    ap.add_argument("--n_embd", type=int, default=None)
    ap.add_argument("--n_head", type=int, default=None)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--variants", default="eager:flash,compiled,compiled:torch")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script only")
    args = ap.parse_args()
    use_keyed_cache()  # not another version's custom-op graphs
    variants = [(v, *parse_variant(v)) for v in args.variants.split(",")]

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    over = dict(block_size=args.seq)
    over.update({k: getattr(args, k) for k in ("n_embd", "n_head") if getattr(args, k)})
    if args.layers is not None:
        over["n_layer"] = max(args.layers, 1)
    with torch.device(args.device):
        model = GPT(GPTConfig.from_preset(args.preset, **over))
    if args.layers == 0:  # embeddings, final LayerNorm and loss only
        model.transformer.h = torch.nn.ModuleList()
    buf = torch.randint(
        0, model.config.vocab_size, (args.batch * args.seq + 1,), device=args.device
    )
    views = buf[:-1].view(args.batch, -1), buf[1:].view(args.batch, -1)  # as the data loader
    copies = tuple(t.clone() for t in views)
    dropouts = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    print(
        f"{args.preset} layers {len(model.transformer.h)} width {model.config.n_embd} heads "
        f"{model.config.n_head} B {args.batch} T {args.seq} | torch "
        f"{torch.__version__} | {args.device}",
        flush=True,
    )

    refs = {}
    for impl in sorted({o["impl"] for _, _, o in variants}):
        use_loss(model, impl)
        loss, grads = step(model, model, *views)
        refs[impl] = loss, {n: g.clone() for n, g in grads.items()}
        print(
            f"reference eager {impl}: loss {loss.item():.5f} grad norm "
            f"{grad_norm(grads.values()).item():.5f}",
            flush=True,
        )

    rows = []
    for name, compiled, o in variants:
        import torch._functorch.config as functorch_config

        torch._dynamo.reset()
        use_loss(model, o["impl"])
        settings = contextlib.ExitStack()
        if o["flash"]:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            settings.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
        if o["budget"] is not None:
            settings.enter_context(functorch_config.patch(activation_memory_budget=o["budget"]))
        if o["inductor"]:
            import torch._inductor.config as inductor_config

            settings.enter_context(inductor_config.patch(**o["inductor"]))
        if o["trainer"]:
            from gpt2_fused.training import compile_settings, config

            trainer = config.TrainConfig(batch_size=args.batch)  # not "auto": the rows it runs
            trainer.model = model.config
            settings.enter_context(compile_settings.compiler_settings(trainer))
        for n, m in dropouts.items():  # put back, or swapped for Identity
            set_submodule(model, n, torch.nn.Identity() if o["nodrop"] else m)
        t0 = time.perf_counter()
        with settings:
            fn = torch.compile(model) if compiled else model
            xy = copies if o["separate"] else views
            loss, grads = step(fn, model, *xy, autocast=not o["fp32"])
        secs = time.perf_counter() - t0
        ref_loss, ref_grads = refs[o["impl"]]
        errs = {
            n: (
                torch.linalg.vector_norm(g - ref_grads[n])
                / torch.linalg.vector_norm(ref_grads[n]).clamp_min(1e-30)
            ).item()
            for n, g in grads.items()
        }
        worst = max(errs, key=errs.get)
        rows.append(
            (
                name,
                loss.item(),
                abs(loss - ref_loss).item(),
                grad_norm(grads.values()).item(),
                errs[worst],
                worst,
                secs,
            )
        )
        print(
            f"{name}: loss {rows[-1][1]:.5f} |dloss| {rows[-1][2]:.2e} grad norm "
            f"{rows[-1][3]:.5f} worst grad err {errs[worst]:.2e} ({worst}) {secs:.0f} s",
            flush=True,
        )

    print("\n| variant | loss | abs diff vs eager | grad norm | worst rel grad err (param) |")
    print("|---|---|---|---|---|")
    for name, loss, d, norm, err, worst, _ in rows:
        print(f"| {name} | {loss:.5f} | {d:.2e} | {norm:.5f} | {err:.2e} ({worst}) |")


if __name__ == "__main__":
    main()
