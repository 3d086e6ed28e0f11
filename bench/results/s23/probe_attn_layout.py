"""Does cuDNN's attention run slower on q, k, v as views of c_attn's (B, T, 3C) output (ours)
than on separate (B, T, C) buffers? The 1558M:16 traces (results/s23/call2/) had the same
backward kernel 1.5 ms a step slower in ours than in plain. GPU ms a call (bench.common.timed,
host hidden, median of 20), forward and backward, at 124M:64 and 1558M:16 shapes.
    PYTHONPATH=. python3 bench/results/s23/probe_attn_layout.py"""

import torch

from bench.common import timed

op, op_bwd = (torch.ops.aten._scaled_dot_product_cudnn_attention,
              torch.ops.aten._scaled_dot_product_cudnn_attention_backward)  # fmt: skip


def heads(t, B, T, nh, hs):
    return t.view(B, T, nh, hs).transpose(1, 2)


def measure(q, k, v, dout):
    """(forward ms, backward ms, the three gradients) of causal cuDNN attention."""
    T = q.shape[2]
    out, lse, *_, seed, off, _ = op(q, k, v, None, True, 0.0, True, False)

    def bwd():
        return op_bwd(dout, q, k, v, out, lse, seed, off, None, None, None, T, T, 0.0, True)

    fwd_ms = timed(lambda: op(q, k, v, None, True, 0.0, True, False), 20, hide_host=True)
    return fwd_ms, timed(bwd, 20, hide_host=True), bwd()


def main():
    for name, B, nh in (("124M:64", 64, 12), ("1558M:16", 16, 25)):
        T, hs = 1024, 64
        C = nh * hs
        qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16)
        dout = heads(torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16), B, T, nh, hs)
        layouts = {
            "views of qkv": [heads(t, B, T, nh, hs) for t in qkv.split(C, dim=2)],
            "three buffers": [heads(t.contiguous(), B, T, nh, hs) for t in qkv.split(C, dim=2)],
        }
        ref = None
        for lname, (q, k, v) in layouts.items():
            fwd, bwd, g = measure(q, k, v, dout)
            equal = "" if ref is None else f", grads equal: {all(map(torch.equal, ref, g))}"
            ref = g
            print(f"{name} {lname}: fwd {fwd:.4f} ms, bwd {bwd:.4f} ms, "
                  f"dq strides {g[0].stride()}{equal}")  # fmt: skip


if __name__ == "__main__":
    main()
