"""torch.compile's settings for a run: its mode (CUDA graphs or not) and Inductor's configuration,
with this repo's patches to Inductor (persistent LayerNorm rows, the LayerNorm partial sums
finished by grad_sums.row_sum, the tied embedding's gradient scattered into the classifier's).

At 774M and 1558M, torch.compile with Inductor's in-place buffers has produced a training step
with a wrong loss and gradients, whose cause is not known and whose results vary from run to
run (bench/RESULTS.md#compile). `buffer_reuse="no_inplace"` avoids the known case;
compile_guard.py catches others.
"""

import contextlib
import re

import torch

BUFFER_REUSE = {  # buffer_reuse -> torch._inductor.config patch
    "all": {},
    "no_inplace": dict(inplace_buffers=False),
    "none": dict(inplace_buffers=False, allow_buffer_reuse=False),
}
COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# elements. Inductor keeps a row in registers (a "persistent" reduction: one read) only up to
# this; a wider row is reduced in a loop and read twice (torch/_inductor/choices.py)
INDUCTOR_PERSISTENT_ROWS = 1024
# Inductor fuses each LayerNorm backward's dx with partial sums of dw and db, split_size rows a
# program, then finishes them with an eager column sum. Its split_size (rows / (8 x SMs), clamped
# to 16-128) leaves 512 partial rows at 124M:8, where ATen's sum is slowest; these many partial
# rows were the best split or within 0.2 us of it at every shape measured, 768 wide (124M:8-64)
# and 1600 wide (1558M:4, 16) (bench/RESULTS.md#layernorm-backwards-column-sums)
LAYERNORM_PARTIAL_ROWS = 1024  # up to 1024 wide
WIDE_LAYERNORM_PARTIAL_ROWS = 256  # wider


# FLOP per layer of one micro-batch's forward and backward (model.flops_per_token) below which
# "auto" records CUDA graphs: there the host's launches (~3 ms a layer on the default path)
# outlast the GPU's work. 124M at micro-batch 8 and 16 (0.58e12 and 1.17e12) ran 2.6x and 1.3x
# faster with them; at 32 and 64 (2.3e12, 4.7e12) 1.5 % and 0.5 % slower, with 0.4 GiB more
# memory; 1558M at 16 is 3.5e12 (bench/RESULTS.md#cuda-graphs)
GRAPHS_BELOW_FLOP_PER_LAYER = 1.5e12


def pick_mode(mode, device, bucketed, flop_per_layer):
    """torch.compile's mode; "auto" is "reduce-overhead" (CUDA graphs: the step replayed, not
    launched op by op) on a GPU whose micro-batch is small enough for the host to pace the step
    (flop_per_layer: one micro-batch's forward and backward FLOP over n_layer), else "default".
    bucketed: under torchrun the grads are summed in DDP's buckets or FSDP2's during the
    backward, which graphs cannot hold ("default"; data_parallel.graphs_fit)."""
    if mode != "auto":
        return mode
    graphs = device.type == "cuda" and not bucketed and flop_per_layer < GRAPHS_BELOW_FLOP_PER_LAYER
    return "reduce-overhead" if graphs else "default"


def uses_cuda_graphs(mode):
    return mode in ("reduce-overhead", "max-autotune")


def _row_is_persistent(features, cooperative_reduction, limit, inherited):
    """Inductor's choice for one reduction kernel, but True for an inner reduction (over the
    last dim: LayerNorm's mean and variance) of a static size up to `limit`."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.hints import ReductionHint

    n = features.reduction_numel
    static = isinstance(n, int) or getattr(n, "is_number", False)
    if (
        static
        and int(n) <= limit
        and not cooperative_reduction
        and inductor_config.triton.persistent_reductions
        and not inductor_config.triton.multi_kernel
        and features.get_reduction_hint() == ReductionHint.INNER
    ):
        return True
    return inherited(features, cooperative_reduction)


def _cache_tag(tag, graph_pass=None):
    """A post-grad pass whose uuid carries `tag` into Inductor's and AOTAutograd's cache keys
    (with the tags of the pass it replaces, which it still runs first), so that a graph compiled
    under another patch of Inductor is not reused from disk; it runs `graph_pass(graph)` too,
    where one is given."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    inner = inductor_config.post_grad_custom_post_pass

    class CacheTag(CustomGraphPass):
        def __call__(self, graph):
            if inner is not None:
                inner(graph)
            if graph_pass is not None:
                graph_pass(graph)

        def uuid(self):
            return tag if inner is None else f"{inner.uuid()},{tag}"

    return inductor_config.patch(post_grad_custom_post_pass=CacheTag())


def _call(graph, target, *args):
    """A node calling target(*args), inserted at the graph's insertion point, with the fake
    value (shape, dtype) that later passes read from meta["val"]."""
    import torch.fx
    from torch._guards import detect_fake_mode
    from torch.utils._pytree import tree_map_only

    node = graph.call_function(target, args)
    vals = tree_map_only(torch.fx.Node, lambda n: n.meta["val"], args)
    with detect_fake_mode(vals):
        node.meta["val"] = target(*vals)
    return node


def _put_into_zeros(node):
    """Whether an fx node scatter-adds rows into a new buffer of zeros, as the decomposed
    embedding backward does: `_unsafe_masked_index_put_accumulate(zeros, mask, [idx], rows)`
    (torch 2.13) or an accumulating `index_put(zeros, [idx], rows, True)` (torch 2.11's CUDA
    backward; `_unsafe_index_put` alike)."""
    aten = torch.ops.aten
    if node.target in (aten._unsafe_index_put.default, aten.index_put.default):
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate")
        if accumulate is not True:
            return False
    elif node.target is not aten._unsafe_masked_index_put_accumulate.default:
        return False
    zeros = node.args[0]
    return len(node.users) == 1 and zeros.target is aten.full.default and zeros.args[1] == 0


def _tied_sum(node):
    """(dW, the embedding's put) where node adds dW to the embedding's rows scattered into zeros,
    both of one shape and dtype; else None."""
    import torch.fx

    if node.target is not torch.ops.aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    out = node.meta.get("val")
    for put, dw in (node.args, node.args[::-1]):
        if not (isinstance(put, torch.fx.Node) and isinstance(dw, torch.fx.Node)):
            continue
        other = dw.meta.get("val")
        if out is None or other is None or other.shape != out.shape or other.dtype != out.dtype:
            continue  # a broadcast or a promoted sum: left as it is
        if _put_into_zeros(put):
            return dw, put
    return None


def _masked_put(graph, dw, mask, indices, rows):
    """dW with rows scatter-added at indices where mask holds, as Inductor lowers the masked put:
    the indices clamped into range, the masked-out rows' values 0."""
    aten = torch.ops.aten
    kept = _call(graph, aten.where.ScalarOther, mask, rows, 0.0)
    clamped = []  # in two ops that Inductor lowers (it decomposes clamp)
    for i, n in zip(indices, dw.meta["val"].shape, strict=False):
        if i is not None:
            i = _call(graph, aten.clamp_min.default, i, 0)
            i = _call(graph, aten.clamp_max.default, i, n - 1)
        clamped.append(i)
    return _call(graph, aten._unsafe_index_put.default, dw, clamped, kept, True)


def scatter_tied_grad(graph):
    """Rewrite a post-grad backward graph so that the token embedding's gradient is scattered
    into the tied classifier's, not into zeros and then added; returns the number of rewrites.

    The tied weight (V, D) gets two gradients: the classifier's dW and the embedding's rows.
    Inductor's decomposition of the embedding's backward scatters the rows into a new (V, D)
    buffer of zeros, and autograd's sum then reads that and dW and writes a third: at 124M
    three passes over 154 MB of fp32 a micro-batch. As

        add(dW, put(zeros, [idx], rows))  ->  put(dW, [idx], rows)

    (put: an accumulating index_put; torch 2.13's masked put becomes a plain one, as Inductor
    lowers it) it takes one: dW's copy, or none where Inductor puts into dW in place. The same
    sum in another order (the atomic adds were unordered already)."""
    aten = torch.ops.aten
    done = 0
    for node in list(graph.nodes):
        found = _tied_sum(node)
        if found is None:
            continue
        dw, put = found
        zeros = put.args[0]
        with graph.inserting_before(node):
            if put.target is aten._unsafe_masked_index_put_accumulate.default:
                summed = _masked_put(graph, dw, *put.args[1:])
            else:
                summed = _call(graph, put.target, dw, put.args[1], put.args[2], True)
        node.replace_all_uses_with(summed)
        graph.erase_node(node)
        graph.erase_node(put)
        if not zeros.users:
            graph.erase_node(zeros)
        done += 1
    return done


@contextlib.contextmanager
def tied_grad_scatter(enabled=True):
    """scatter_tied_grad as Inductor's post-grad pass while the context lasts (and in its cache
    key): the embedding's rows go straight into the tied classifier's gradient
    (its cost: bench/RESULTS.md#host-cost)."""
    if not enabled:
        yield
        return
    with _cache_tag("tied_grad_scatter", scatter_tied_grad):
        yield


@contextlib.contextmanager
def persistent_rows(limit):
    """Inductor reduces rows of up to `limit` elements in registers while the context lasts, so
    LayerNorm at 1280 and 1600 wide (774M, 1558M) reads its inputs once, not twice
    (bench/RESULTS.md#persistent-layernorm-rows). Inductor's heuristic is a static method of
    InductorChoices: patched for every thread (the backward compiles in autograd's), and `limit`
    joins Inductor's cache key (_cache_tag)."""
    if limit <= INDUCTOR_PERSISTENT_ROWS:
        yield
        return
    from torch._inductor.choices import InductorChoices

    inherited = InductorChoices.should_use_persistent_reduction

    def wide(features, cooperative_reduction=False):
        return _row_is_persistent(features, cooperative_reduction, limit, inherited)

    InductorChoices.should_use_persistent_reduction = staticmethod(wide)
    try:
        with _cache_tag(f"persistent_rows={limit}"):
            yield
    finally:
        InductorChoices.should_use_persistent_reduction = staticmethod(inherited)


# The eager line Inductor's wrapper finishes each partial sum of a mix-order reduction with
# (torch/_inductor/codegen/simd.py), "buf9 = buf7[0 * 786432 : (0 + 1) * 786432].view(1024,
# 768).sum(dim=0)", where a ".to(dtype)" or ".view(shape)" may follow
FINAL_SUM = re.compile(
    r"(?P<lhs>\w+ = )(?P<rows>\w+\[[^\]]*\]\.view\([^()]*\))\.sum\(dim=0\)(?P<rest>.*)"
)
ROW_SUM_IMPORT = "from gpt2_fused.kernels.grad_sums import row_sum"


def row_sum_line(line):
    """Inductor's finishing line with grad_sums.row_sum in place of torch's sum (None: not one)."""
    m = FINAL_SUM.fullmatch(line) if isinstance(line, str) else None
    return None if m is None else f"{m['lhs']}row_sum({m['rows']}){m['rest']}"


@contextlib.contextmanager
def triton_partial_sums(enabled=True):
    """While the context lasts, Inductor's generated code finishes the partial sums of a mix-order
    reduction (each LayerNorm backward's dw and db: (P, C) fp32, P ~1024) with grad_sums.row_sum,
    one Triton launch, instead of ATen's column sum, which at these shapes splits the rows over
    blocks that meet at a semaphore: a memset and a kernel of 6-11 us each, two of each per
    LayerNorm (bench/RESULTS.md#layernorm-backwards-column-sums). The same sum in another order.

    Inductor writes those lines one by one into its wrapper; the patch wraps its mix-order
    codegen (a method of SIMDScheduling, for every thread) and rewrites them as they are
    written. Where this torch has no such method, or a C++ wrapper is asked for, nothing
    changes. Joins the cache key (_cache_tag)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.codegen.simd import SIMDScheduling

    inherited = getattr(SIMDScheduling, "_codegen_mix_order_reduction", None)
    if not enabled or inherited is None or inductor_config.cpp_wrapper:
        yield
        return

    def codegen(self, node1, node2):
        from torch._inductor.virtualized import V

        wrapper = V.graph.wrapper_code
        saved = wrapper.__dict__.get("writeline")  # set when this call is nested in another
        writeline = wrapper.writeline

        def rewrite(line):
            new = row_sum_line(line)
            if new is not None:
                writeline(ROW_SUM_IMPORT)  # a sys.modules look-up after the first
            writeline(line if new is None else new)

        wrapper.writeline = rewrite
        try:
            return inherited(self, node1, node2)
        finally:
            if saved is None:
                del wrapper.writeline
            else:
                wrapper.writeline = saved

    SIMDScheduling._codegen_mix_order_reduction = codegen
    try:
        with _cache_tag("triton_partial_sums"):
            yield
    finally:
        SIMDScheduling._codegen_mix_order_reduction = inherited


def layernorm_split(rows, width, setting):
    """Inductor's mix_order_reduction_split_size for LayerNorms over `rows` rows of `width`:
    rows / the partial rows wanted (setting; -1: the constants above, by width), down to a power
    of two; None (Inductor's own) for setting 0 or where that is under 8 or over 128 rows a
    program (not measured)."""
    if setting == 0:
        return None
    wide = width > INDUCTOR_PERSISTENT_ROWS
    partial = (
        setting if setting > 0 else WIDE_LAYERNORM_PARTIAL_ROWS if wide else LAYERNORM_PARTIAL_ROWS
    )
    split = rows // partial
    if split < 8:
        return None
    split = 1 << (split.bit_length() - 1)
    return split if split <= 128 else None


@contextlib.contextmanager
def compiler_settings(cfg):
    """torch.compile's global settings from cfg, for as long as the context lasts."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor = dict(coordinate_descent_tuning=cfg.coordinate_descent_tuning)
    inductor.update(BUFFER_REUSE[cfg.buffer_reuse])
    rows = cfg.batch_size * cfg.model.block_size
    split = layernorm_split(rows, cfg.model.n_embd, cfg.layernorm_partial_rows)
    if split is not None:
        inductor["triton.mix_order_reduction_split_size"] = split
    budget = dict(activation_memory_budget=cfg.activation_memory_budget)
    with functorch_config.patch(**budget), inductor_config.patch(**inductor):
        with persistent_rows(cfg.persistent_rows), triton_partial_sums(cfg.triton_partial_sums):
            with tied_grad_scatter(cfg.tied_grad_scatter):
                yield
