"""One cuBLASLt matmul with an epilogue, called through ctypes: torch reaches cuBLASLt's bias and
plain GELU epilogues (addmm, torch._addmm_activation) but not GELU_AUX_BIAS or DGELU.

    matmul(a, b, out, bias=None, aux=None, epilogue=EPI_DEFAULT)   # out = a @ b, then epilogue

a (m, k), b (k, n), out (m, n): CUDA tensors of one float dtype, each row-major or a transposed
view of one; fp32 accumulation. cuBLAS is column-major, so a row-major (m, n) matrix is its
(n, m) transpose: out^T = b^T @ a^T is what cuBLASLt is asked for (cuBLAS "A" = b, "B" = a).
Epilogues used (values from cublasLt.h):
    GELU_AUX_BIAS  out = gelu_tanh(a @ b + bias), aux = a @ b + bias (the pre-activation)
    DGELU          out = (a @ b) * gelu_tanh'(aux)
The first call of each shape / layout / epilogue times the heuristic's first 8 algorithms on
the call's own operands and keeps the fastest (TUNING records the times): the heuristic's first
pick was up to 7 % slower on GPT-2's shapes (bench/RESULTS.md, session 20).
The library is the libcublasLt this process has loaded (torch's), else one found by its soname
or under the nvidia/ pip packages next to torch.
"""

import ctypes
import functools
import glob
import os

import torch

COMPUTE_32F = 68  # cublasComputeType_t
DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8  # cublasLtMatmulDesc...
DESC_AUX_POINTER, DESC_AUX_LD = 11, 12  # ...Attributes_t
PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
EPI_DEFAULT, EPI_GELU_AUX_BIAS, EPI_DGELU = 1, 32 | 128 | 4, 64 | 128  # cublasLtEpilogue_t
WORKSPACE = 32 * 2**20  # bytes, what cuBLAS asks for on Hopper
CANDIDATES = 8
ALGOS = {}  # (device, key) -> the fastest algorithm measured for that key
TUNING = {}  # key -> ms of each candidate, in the heuristic's order


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
    raise RuntimeError(
        "cuBLASLt (libcublasLt) not found next to torch: the MLP's GELU epilogues need it; "
        "train with --mlp_impl=torch instead"
    )


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def _handle(device_index):
    """The cuBLASLt handle and the workspace of one device."""
    handle = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(handle)), "create")
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=f"cuda:{device_index}")
    return handle, workspace


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
    """The operation descriptor, the A, B, D layouts and the search preference of one key."""
    (opa, ra, ca, lda, ta), (opb, rb, cb, ldb, tb), (n, m, td), epilogue = key
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
    size = ctypes.c_uint64(WORKSPACE)
    _check(
        lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(size), 8),
        "preference attribute",
    )
    return desc, layouts, pref


def matmul(a, b, out, *, bias=None, aux=None, epilogue=EPI_DEFAULT):
    """out = a @ b, then `epilogue` (module docstring): bias (n,), aux (m, n) where it uses them."""
    m, n = out.shape
    if out.stride() != (n, 1) or (
        aux is not None and (aux.shape, aux.stride()) != (out.shape, (n, 1))
    ):
        raise ValueError("cuBLASLt matmul: out and aux must be contiguous (m, n)")
    opa, ra, ca, lda = _operand(b)  # cuBLAS A = b^T (n, k)
    opb, rb, cb, ldb = _operand(a)  # cuBLAS B = a^T (k, m)
    key = (
        (opa, ra, ca, lda, DTYPES[b.dtype]),
        (opb, rb, cb, ldb, DTYPES[a.dtype]),
        (n, m, DTYPES[out.dtype]),
        epilogue,
    )
    desc, (layout_a, layout_b, layout_d), pref = _plan(key)
    if bias is not None:
        _set(desc, DESC_BIAS_POINTER, bias.data_ptr(), ctypes.c_void_p)
    if aux is not None:
        _set(desc, DESC_AUX_POINTER, aux.data_ptr(), ctypes.c_void_p)
    dev = out.device.index
    handle, workspace = _handle(dev)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    stream = ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream)

    def launch(algo):  # beta = 0: C is not read; D = out
        return _lib().cublasLtMatmul(
            handle, desc, ctypes.byref(alpha), b.data_ptr(), layout_a, a.data_ptr(), layout_b,
            ctypes.byref(beta), out.data_ptr(), layout_d, out.data_ptr(), layout_d,
            ctypes.byref(algo), workspace.data_ptr(), WORKSPACE, stream,
        )  # fmt: skip

    if (dev, key) not in ALGOS:
        ALGOS[dev, key] = _fastest(handle, desc, (layout_a, layout_b, layout_d), pref, launch, key)
    _check(launch(ALGOS[dev, key]), "matmul")
    return out


def _fastest(handle, desc, layouts, pref, launch, key, reps=3):
    """The fastest of the heuristic's first CANDIDATES algorithms, timed on this call's operands."""
    layout_a, layout_b, layout_d = layouts
    found = (_Heuristic * CANDIDATES)()
    count = ctypes.c_int(0)
    _check(
        _lib().cublasLtMatmulAlgoGetHeuristic(
            handle, desc, layout_a, layout_b, layout_d, layout_d, pref, CANDIDATES, found,
            ctypes.byref(count),
        ),
        "heuristic",
    )  # fmt: skip
    if count.value == 0:
        raise RuntimeError(f"cuBLASLt offers no algorithm for {key}; try --mlp_impl=torch")
    times = []
    for result in found[: count.value]:
        if result.state != 0 or launch(result.algo) != 0:  # the untimed first launch warms up
            times.append(float("inf"))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            launch(result.algo)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    TUNING[key] = times
    return found[min(range(len(times)), key=times.__getitem__)].algo
