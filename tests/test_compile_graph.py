"""The compiled model is one graph: no Python-side probing inside the traced forward.

torch.compile traces GPT.forward with Dynamo, which cannot trace ctypes (it graph-breaks) and
ignores functools.cache (it re-traces the cached body every time). So library probing
(gpt2_fused/kernels/cublaslt.py loads libcublasLt through ctypes) and cached look-ups must be
decided once, outside the forward. The CPU test walks the functions the forward can call, by the
names their bytecode loads, and fails on any such probe; the GPU test compiles with
fullgraph=True for every fast-path switch.
"""

import builtins
import ctypes
import dis
import functools
import types

import pytest
import torch

from gpt2_fused.kernels import cublaslt, fast_paths
from gpt2_fused.kernels.launch import capability
from model import GPT, GPTConfig

OURS = ("model", "fused_loss", "gpt2_fused", "data")  # modules whose functions the walk follows


def _probe(obj):
    """Why obj must not be reachable from a traced forward, or None."""
    if obj is ctypes or getattr(obj, "__module__", None) == "ctypes":
        return "ctypes"
    if isinstance(obj, functools._lru_cache_wrapper):
        return "a functools.cache function (Dynamo re-traces its body at every call)"
    if callable(obj) and getattr(obj, "__module__", None) == cublaslt.__name__:
        return "gpt2_fused.kernels.cublaslt's Python side (ctypes)"
    if obj is capability:  # a device query and an environment read (kernels/fast_paths.py)
        return "the GPU's compute capability"
    return None


def _ours(fn):
    mod = getattr(fn, "__module__", None) or ""
    return isinstance(fn, types.FunctionType) and mod.split(".")[0] in OURS


class _Method(tuple):
    """(function, class) of a `self.name` call."""


def _calls(fn, cls):
    """Objects fn's bytecode names: globals, closure cells, module attributes and, for
    self.name, methods of cls.

    Approximate on purpose: it follows `name`, `module.attr` and `self.method`, which is how this
    repo's forward code calls things; custom ops are opaque to Dynamo and are not entered.
    """
    out, prev = [], None
    codes = [fn.__code__]
    codes += [c for c in fn.__code__.co_consts if isinstance(c, types.CodeType)]
    for code in codes:
        for ins in dis.get_instructions(code):
            obj = None
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                name = ins.argval
                obj = fn.__globals__.get(name, getattr(builtins, name, None))
            elif ins.opname == "LOAD_DEREF" and ins.argval in fn.__code__.co_freevars:
                cell = fn.__closure__[fn.__code__.co_freevars.index(ins.argval)]
                obj = cell.cell_contents
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and prev is not None:
                base, name = prev, ins.argval
                if base == "self" and cls is not None:
                    attr = getattr(cls, name, None)
                    obj = _Method((attr, cls)) if isinstance(attr, types.FunctionType) else None
                elif isinstance(base, types.ModuleType):
                    obj = getattr(base, name, None)
            elif ins.opname.startswith("LOAD_FAST") and ins.argval == "self":
                obj = "self"
            if obj is not None and obj != "self":
                out.append(obj)
            prev = obj
    return out


def reachable_probes(roots):
    """(path, reason) for every probe reachable from roots, a list of (function, class or None)."""
    found, seen = [], set()
    stack = [(fn, cls, fn.__qualname__) for fn, cls in roots]
    while stack:
        fn, cls, path = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for obj in _calls(fn, cls):
            target, owner = obj if isinstance(obj, _Method) else (obj, None)
            why = _probe(target)
            name = getattr(target, "__qualname__", repr(target))
            if why:
                found.append((f"{path} -> {name}", why))
            elif _ours(target) or owner is not None:  # self.method: the module's own
                stack.append((target, owner, f"{path} -> {name}"))
    return found, seen


def _forward_roots(model):
    return [(type(m).forward, type(m)) for m in model.modules() if "forward" in vars(type(m))]


@pytest.mark.parametrize("mlp_impl", ["torch", "fast"])
@pytest.mark.parametrize("loss_impl", ["torch", "fast"])
def test_forward_reaches_no_library_probe(loss_impl, mlp_impl):
    """Nothing the training forward can call probes a library or hides behind functools.cache."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, loss_impl=loss_impl, mlp_impl=mlp_impl))
    found, seen = reachable_probes(_forward_roots(model))
    assert not found, found
    # the walk is not vacuous: it reaches the fast paths' entry points
    from fused_loss import fused_linear_cross_entropy
    from gpt2_fused.kernels.attention import attention_fast
    from gpt2_fused.kernels.mlp import mlp_cublaslt

    assert {fused_linear_cross_entropy, mlp_cublaslt, attention_fast} <= seen


def test_the_walk_finds_a_probe():
    """The walker's negative control: a forward that asks cublaslt.available() is caught, also
    through a helper and through a method."""

    def helper(x):
        return cublaslt.available() and x

    helper.__module__ = "model"  # as if defined there: the walk follows this repo's functions

    class Probing(torch.nn.Module):
        def forward(self, x):
            return self._inner(x)

        def _inner(self, x):
            return helper(x)

    found, _ = reachable_probes([(Probing.forward, Probing)])
    assert found and found[0][0].endswith("helper -> available"), found

    def asks_the_gpu(x):  # the fast-path table's GPU check: for construction, not the forward
        return fast_paths.gpu_runs("mlp") and x

    asks_the_gpu.__module__ = "model"
    found, _ = reachable_probes([(asks_the_gpu, None)])
    assert found and found[0][0].endswith("asks_the_gpu -> gpu_runs -> capability"), found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn_impl", ["torch", "fast"])
@pytest.mark.parametrize("low_precision_residual", [True, False])
@pytest.mark.parametrize("mlp_impl", ["torch", "fast"])
@pytest.mark.parametrize("loss_impl", ["torch", "fast"])
def test_gpu_fullgraph_for_every_switch(loss_impl, mlp_impl, low_precision_residual, attn_impl):
    """torch.compile(fullgraph=True) of a training step (bf16 autocast, fp32 weights) for every
    fast-path switch: a graph break raises; the loss matches eager mode's."""
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=2,
        n_head=4,
        n_embd=128,
        block_size=64,
        loss_impl=loss_impl,
        mlp_impl=mlp_impl,
        low_precision_residual=low_precision_residual,
        attn_impl=attn_impl,
    )
    model = GPT(cfg).cuda()
    assert model.transformer.h[0].mlp.use_cublaslt == (mlp_impl == "fast")
    assert model.transformer.h[0].attn.use_fast == (attn_impl == "fast")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    idx = torch.randint(0, cfg.vocab_size, (4, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(idx, idx)
        loss = compiled(idx, idx)
        explained = torch._dynamo.explain(model)(idx, idx)
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=2e-2, atol=2e-2)
    assert explained.graph_break_count == 0, explained.break_reasons
