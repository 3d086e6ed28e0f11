"""Compile Triton kernels for Hopper (sm_90) on any machine, GPU or not: the helpers of the
tests' compile checks (test_fused_loss_compile.py, test_grad_sums.py, test_adamw.py, test_gemv.py;
a script names its target, so test_fast_paths.py builds for sm_80 and sm_86 the same way).

The Triton wheel ships ptxas, so a CPU-only CI can run the real compiler down to a cubin. That
catches what the interpreter lets through (a kernel reading a plain Python global, say, which the
interpreter allows and the compiler rejects) and checks the generated code (vector widths,
registers, spills). Each check is a script run in a subprocess without TRITON_INTERPRET, which
conftest.py sets for the tests.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_nvidia_backend():
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


needs_nvidia_backend = pytest.mark.skipif(
    not _has_nvidia_backend(), reason="this Triton has no NVIDIA backend"
)

# A script's prelude: ptxas_v(ptx), ptxas -v's report (registers, spills) on a PTX text
PTXAS_V = r"""
import os, subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas


def ptxas_v(ptx):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        info = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", path, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True)
    return info.stdout + info.stderr
"""


def compile_for_sm90(script):
    """Run `script` in a subprocess from the repository root without TRITON_INTERPRET (so triton
    compiles for real) and return the JSON its last line prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when unset; 1 is its default
    p = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
