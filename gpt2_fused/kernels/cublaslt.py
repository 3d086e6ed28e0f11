"""One cuBLASLt matmul with an epilogue, called through ctypes: torch reaches cuBLASLt's bias and
plain GELU epilogues (addmm, torch._addmm_activation) but not GELU_AUX_BIAS or DGELU, nor a bias
epilogue that also adds a separate matrix C, and does not let the algorithm be chosen by timing.

    matmul(a, b, out, bias=None, aux=None, epilogue=EPI_DEFAULT)     # out = a @ b, then epilogue
    matmul(a, b, out, beta=1.0)                                      # out += a @ b
    matmul(a, b, out, c=c, beta=1.0, bias=bias, epilogue=EPI_BIAS)   # out = a @ b + c + bias

a (m, k), b (k, n): CUDA tensors of one float dtype; out (m, n) in it or fp32; each row-major or
a transposed view of one (out contiguous); fp32 accumulation. c (m, n): what beta scales instead
of out (cuBLASLt's C, out its D), contiguous in out's dtype, read only. cuBLAS is column-major,
so a row-major (m, n) matrix is its (n, m) transpose: out^T = b^T @ a^T is what cuBLASLt is
asked for (cuBLAS "A" = b, "B" = a).
Epilogues used (values from cublasLt.h); bias (n,) is broadcast over rows and read in out's
dtype (cuBLASLt's default bias type is D's):
    BIAS           out = a @ b + beta * C + bias (C = c, or out itself)
    GELU_AUX_BIAS  out = gelu_tanh(a @ b + bias), aux = a @ b + bias (the pre-activation)
    DGELU          out = (a @ b) * gelu_tanh'(aux)
The first call of each shape / layout / alignment / epilogue / workspace limit times the
heuristic's first `candidates` algorithms (and the caller's `reference`, if given) and keeps the
fastest (TUNING records the times): the heuristic's first pick was up to 7 % slower on GPT-2's
MLP shapes (bench/RESULTS.md#mlp). With beta = 0, or a separate c, the timing runs on the call's
own operands and only overwrites out, which the call's launch then rewrites; tune_beta = 1 times
them as accumulating calls (the classifier's first dw chunk). With beta != 0 and C = out a zero
stand-in replaces one operand, so that out keeps its sum (_timing_operands). The pick is per
process: two runs may pick differently (not bitwise equal).
The library is the libcublasLt this process has loaded (torch's), else one found by its soname
or under the nvidia/ pip packages next to torch.
"""

import ctypes
import functools
import glob
import os
import warnings

import torch

COMPUTE_32F = 68  # cublasComputeType_t
DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8  # cublasLtMatmulDesc...
DESC_AUX_POINTER, DESC_AUX_LD = 11, 12  # ...Attributes_t
PREF_MAX_WORKSPACE, PREF_MIN_ALIGNMENT_A = 1, 5  # cublasLtMatmulPreferenceAttributes_t (B, C,
# D: 6, 7, 8): the heuristic assumes 256-byte aligned operands unless told less
EPI_DEFAULT, EPI_BIAS = 1, 4  # cublasLtEpilogue_t
EPI_GELU_AUX_BIAS, EPI_DGELU = 32 | 128 | EPI_BIAS, 64 | 128
WORKSPACE = 32 * 2**20  # bytes, what cuBLAS asks for on Hopper
CANDIDATES = 8
ALGOS = {}  # (device, key, candidates, with a reference) -> the fastest measured for that key
REFERENCE = "reference"  # in ALGOS: the caller's reference GEMM was the fastest
TUNING = {}  # key -> ms of each candidate, in the heuristic's order (then the reference)


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _candidates():
    """libcublasLt paths to try: the one this process has loaded (torch's), then by soname, then
    any under the nvidia/ pip packages next to torch."""
    try:
        with open("/proc/self/maps") as f:
            loaded = sorted({line.split()[-1] for line in f if "libcublasLt.so" in line})
    except OSError:
        loaded = []
    site = os.path.dirname(os.path.dirname(torch.__file__))
    pip = glob.glob(os.path.join(site, "nvidia", "**", "libcublasLt.so*"), recursive=True)
    return loaded + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"] + sorted(pip)


@functools.cache
def _lib():
    vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    pvp, u64 = ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64
    signatures = {
        "cublasLtCreate": [pvp],
        "cublasLtMatmulDescCreate": [pvp, i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [pvp, i32, u64, u64, ctypes.c_int64],
        "cublasLtMatmulPreferenceCreate": [pvp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp] * 7
        + [i32, ctypes.POINTER(_Heuristic), ctypes.POINTER(i32)],
        "cublasLtMatmul": [vp] * 12 + [ctypes.POINTER(u64 * 8), vp, sz, vp],
    }
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        for fn, args in signatures.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = i32
        return lib
    raise RuntimeError("cuBLASLt (libcublasLt) not found next to torch")


@functools.cache
def available():
    """Whether libcublasLt loads here; once per process, with a warning when it does not (the
    MLP and the fused loss then run torch's GEMMs)."""
    try:
        _lib()
    except (RuntimeError, AttributeError) as e:  # not found, or a library without these functions
        warnings.warn(f"{e}; the MLP and the fused loss use torch's GEMMs", stacklevel=2)
        return False
    return True


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def _handle(device_index):
    """The cuBLASLt handle of one device."""
    handle = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(handle)), "create")
    return handle


def _workspace(device, nbytes):
    """A workspace of nbytes for one call, from torch's caching allocator (a few microseconds).
    Not cached across calls: a tensor kept in a global would, if first made while a CUDA graph
    is being recorded (torch.compile's mode="reduce-overhead"), live in that graph's memory
    pool untracked, and cudagraph trees refuse such a pool; made per call it is freed like any
    temporary, and a recorded graph replays it at its recorded address."""
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)


def _set(desc, attr, value, ctype):
    v = ctype(value)
    _check(
        _lib().cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
        f"attribute {attr}",
    )


def _operand(t):
    """(op, rows, cols, ld) that make cuBLAS read 2-D t as the column-major matrix t^T."""
    r, c = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(1, c):  # row-major: memory holds t^T (c, r)
        return OP_N, c, r, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(1, r):  # a transposed view: memory holds t
        return OP_T, r, c, t.stride(1)
    raise ValueError(f"operand with strides {t.stride()} is neither row- nor column-major")


@functools.cache
def _plan(key):
    """The operation descriptor, the A, B, D layouts (D's serves C too: a separate c has out's
    layout) and the search preference of one key."""
    (opa, ra, ca, lda, ta), (opb, rb, cb, ldb, tb), (n, m, td), epilogue, max_workspace, aligns = (
        key
    )
    lib = _lib()
    desc = ctypes.c_void_p()
    _check(
        lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, DTYPES[torch.float32]), "desc"
    )
    _set(desc, DESC_TRANSA, opa, ctypes.c_int32)
    _set(desc, DESC_TRANSB, opb, ctypes.c_int32)
    _set(desc, DESC_EPILOGUE, epilogue, ctypes.c_int32)
    if epilogue in (EPI_GELU_AUX_BIAS, EPI_DGELU):
        _set(desc, DESC_AUX_LD, n, ctypes.c_int64)  # aux is laid out as out
    layouts = []
    for dtype, rows, cols, ld in ((ta, ra, ca, lda), (tb, rb, cb, ldb), (td, n, m, n)):
        layout = ctypes.c_void_p()
        _check(
            lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "layout"
        )
        layouts.append(layout)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    size = ctypes.c_uint64(max_workspace)
    _check(
        lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(size), 8),
        "preference attribute",
    )
    for i, align in enumerate(aligns):  # A, B, C, D
        v = ctypes.c_uint32(align)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(
                pref, PREF_MIN_ALIGNMENT_A + i, ctypes.byref(v), 4
            ),
            "alignment",
        )
    return desc, layouts, pref


def _alignment(t):
    """Bytes (a power of two, at most 256) that t's first element's address is a multiple of."""
    ptr = t.data_ptr()
    return min(256, ptr & -ptr) if ptr else 256


def matmul(
    a,
    b,
    out,
    *,
    bias=None,
    aux=None,
    epilogue=EPI_DEFAULT,
    beta=0.0,
    c=None,
    tune_beta=None,
    candidates=CANDIDATES,
    max_workspace=WORKSPACE,
    reference=None,
):
    """out = a @ b + beta * c (c None: out itself), then `epilogue` (module docstring): bias (n,),
    aux (m, n) where it uses them; c (m, n) contiguous in out's dtype, not overlapping out unless
    it is out. tune_beta (default: beta): the beta the candidates are timed with on a first call;
    candidates: how many of the heuristic's algorithms that timing tries; max_workspace: bytes of
    workspace an algorithm may use; reference(beta, a=, b=): the same GEMM by other means
    (torch's cuBLAS call), timed as one more candidate and run instead when it is the fastest."""
    m, n = out.shape
    if out.stride() != (n, 1) or (
        aux is not None and (aux.shape, aux.stride()) != (out.shape, (n, 1))
    ):
        raise ValueError("cuBLASLt matmul: out and aux must be contiguous (m, n)")
    if c is not None and (c.shape, c.stride(), c.dtype) != (out.shape, (n, 1), out.dtype):
        raise ValueError("cuBLASLt matmul: c must be contiguous (m, n) in out's dtype")
    # the descriptor is cached per key: a bias epilogue without its bias would read the last one
    if epilogue in (EPI_BIAS, EPI_GELU_AUX_BIAS) and (
        bias is None or (bias.shape, bias.stride(), bias.dtype) != ((n,), (1,), out.dtype)
    ):
        raise ValueError("cuBLASLt matmul: a bias epilogue needs bias (n,) in out's dtype")
    if c is not None and c.data_ptr() == out.data_ptr():
        c = None  # out itself (same layout): C = D, in place
    if c is not None and c.data_ptr() % 16:  # seen on the H200 (tests/test_cublaslt.py)
        raise ValueError("cuBLASLt matmul: a separate c must be 16-byte aligned (with less, "
                         "cuBLASLt rounds a @ b to out's dtype before adding it)")  # fmt: skip
    opa, ra, ca, lda = _operand(b)  # cuBLAS A = b^T (n, k)
    opb, rb, cb, ldb = _operand(a)  # cuBLAS B = a^T (k, m)
    key = (
        (opa, ra, ca, lda, DTYPES[b.dtype]),
        (opb, rb, cb, ldb, DTYPES[a.dtype]),
        (n, m, DTYPES[out.dtype]),
        epilogue,
        max_workspace,
        (_alignment(b), _alignment(a), _alignment(out if c is None else c), _alignment(out)),
    )  # a separate c has out's layout: one plan (and algorithm) with or without it
    desc, (layout_a, layout_b, layout_d), pref = _plan(key)
    if bias is not None:
        _set(desc, DESC_BIAS_POINTER, bias.data_ptr(), ctypes.c_void_p)
    if aux is not None:
        _set(desc, DESC_AUX_POINTER, aux.data_ptr(), ctypes.c_void_p)
    dev = out.device.index
    handle, workspace = _handle(dev), _workspace(out.device, max_workspace)
    stream = ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream)

    c_ptr = out.data_ptr() if c is None else c.data_ptr()

    def launch(algo, beta, a=a, b=b):  # C = c or out (not read when beta = 0), D = out
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(beta)
        return _lib().cublasLtMatmul(
            handle, desc, ctypes.byref(alpha), b.data_ptr(), layout_a, a.data_ptr(), layout_b,
            ctypes.byref(beta), c_ptr, layout_d, out.data_ptr(), layout_d,
            ctypes.byref(algo), workspace.data_ptr(), max_workspace, stream,
        )  # fmt: skip

    algo = ALGOS.get(cached := (dev, key, candidates, reference is not None))
    if algo is None:
        found = _heuristic(handle, desc, (layout_a, layout_b, layout_d), pref, key, candidates)
        algo = found[0].algo
        ops = _timing_operands(a, b, beta, c)
        if ops is not None:
            tune = beta if tune_beta is None else tune_beta
            algos = [r.algo for r in found if r.state == 0]
            runs = [functools.partial(launch, algo, tune, **ops) for algo in algos]
            if reference is not None:  # the caller's own GEMM, one more candidate
                runs.append(lambda: reference(tune, **ops) or 0)
                algos.append(REFERENCE)
            algo = ALGOS[cached] = algos[_fastest(runs, key)]
    if algo is REFERENCE:
        reference(beta, a=a, b=b)
    else:
        _check(launch(algo, beta), "matmul")
    return out


def _timing_operands(a, b, beta, c=None):
    """The operands to time candidates on without changing what the call computes: dict(a=, b=).

    beta = 0 or a separate c (out = a @ b + beta * c): the call's own (out is only written, and
    the call's launch rewrites it after). beta != 0 with C = out: out holds what the call adds
    to, so a zero copy of the smaller dense operand stands in for it (out += a @ 0 leaves out as
    it is; a GEMM's time does not depend on the values). None when neither operand is dense (the
    heuristic's first pick then runs, untimed and not kept).
    """
    if beta == 0 or c is not None:
        return dict(a=a, b=b)
    dense = [t for t in (a, b) if t.is_contiguous() or t.t().is_contiguous()]
    if not dense:
        return None
    stand_in = min(dense, key=torch.Tensor.numel)
    zero = torch.zeros_like(stand_in)  # a dense tensor's strides are kept
    return dict(a=zero, b=b) if stand_in is a else dict(a=a, b=zero)


def _heuristic(handle, desc, layouts, pref, key, candidates):
    """The heuristic's first `candidates` algorithms for one plan (at least one)."""
    layout_a, layout_b, layout_d = layouts
    found = (_Heuristic * candidates)()
    count = ctypes.c_int(0)
    _check(
        _lib().cublasLtMatmulAlgoGetHeuristic(
            handle, desc, layout_a, layout_b, layout_d, layout_d, pref, candidates, found,
            ctypes.byref(count),
        ),
        "heuristic",
    )  # fmt: skip
    if count.value == 0:
        raise RuntimeError(f"cuBLASLt offers no algorithm for {key}")
    return found[: count.value]


def _fastest(runs, key, reps=5, rounds=2):
    """Index of the fastest of `runs` (callables returning a cuBLAS status, 0 when it ran): each
    timed over reps calls after an untimed one, in `rounds` interleaved rounds, its best round
    kept (a clock ramp or a neighbour's burst in one round does not decide the pick)."""
    times = [float("inf")] * len(runs)
    ok = [True] * len(runs)
    for _ in range(rounds):
        for i, run in enumerate(runs):
            if not ok[i] or run() != 0:  # the untimed first call warms up
                ok[i] = False
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                run()
            end.record()
            end.synchronize()
            times[i] = min(times[i], start.elapsed_time(end) / reps)
    TUNING[key] = times
    return min(range(len(times)), key=times.__getitem__)
