"""AdamW (and the global grad norm) over every parameter in one Triton launch each.

torch's fused AdamW walks its tensor lists in launches of at most a few hundred blocks, which
leaves GPT-2's 148-580 fp32 tensors short of the bandwidth one launch over the same bytes reaches
(bench/bench_adamw.py, bench/RESULTS.md#adamw). Here every tensor is cut into BLOCK-element
blocks and one program per block finds its tensor through tables of raw addresses (int64 data
pointers, cast to pointers in the kernel):

    tables: ptrs (4, T) p / g / m / v addresses, numel (T,), weight decay (T,)
            block_tensor (B,) int32, block_start (B,) int64: block b covers elements
            [block_start[b], block_start[b] + BLOCK) of tensor block_tensor[b] (masked at numel)

Per parameter (fp32 throughout; torch's fused AdamW's order of operations):
    g = grad / scale                      scale: a device scalar (the clip factor's inverse, >= 1)
    p = p * (1 - lr * wd)
    m = beta1 * m + (1 - beta1) * g,  v = beta2 * v + (1 - beta2) * g^2
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
Bytes per parameter: 28 (reads p g m v, writes p m v); the grads are not written back (torch's
fused step with grad_scale stores the scaled grads). total_norm reads the grads once more (4).
`found_inf` (a device scalar, as torch's fused AdamW takes it from GradScaler) skips the update
where it is non-zero: fp16's loss scaling, gpt2_fused/training/loss_scale.py. Unlike torch's, the
step count t still advances on a skipped step (it is a host number; taking it back would read
the GPU).
`weight_casts` (param -> a bf16/fp16 tensor of its shape) adds a fifth row of addresses: the kernel
also writes p's cast to the compute dtype there (2 bytes), the copy the forward's matmuls read
instead of casting the weight every micro-batch (6 bytes; gpt2_fused/training/weight_casts.py).
The state is torch.optim.AdamW's (exp_avg, exp_avg_sq, a CPU float32 step), so checkpoints move
between the two. adamw_reference and total_norm_reference are the same in plain torch (and
tests/test_adamw.py also checks against torch.optim.AdamW).
"""

import torch
import triton
import triton.language as tl

from gpt2_fused.kernels.interpreter import to_dtype

BLOCK = 4096  # fp32 elements per program: 16 per thread at 8 warps
NUM_WARPS = 8
CAST_CODES = {torch.bfloat16: 1, torch.float16: 2}  # adamw_kernel's CASTS


@triton.jit
def _locate(block_tensor, block_start, numels, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's tensor index, element offsets within it, and their mask. ALIGNED: every
    numel is a multiple of 4 and every address of 16 bytes, which lets the loads be 16 bytes
    wide (the tables hide both from the compiler)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    n = tl.load(numels + t)
    if ALIGNED:
        n = tl.multiple_of(n, 4)
    offs = tl.multiple_of(tl.load(block_start + pid), BLOCK) + tl.arange(0, BLOCK)
    return t, offs, offs < n


@triton.jit
def _address(ptrs, i, ALIGNED: tl.constexpr):
    """Entry i of the address table as an fp32 pointer."""
    ptr = tl.load(ptrs + i).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def sumsq_kernel(ptrs, numels, block_tensor, block_start, partial, T, BLOCK: tl.constexpr,
                  ALIGNED: tl.constexpr):  # fmt: skip
    """partial[block] = sum of the squares of the block's grads (row 1 of ptrs)."""
    t, offs, mask = _locate(block_tensor, block_start, numels, BLOCK, ALIGNED)
    g = tl.load(_address(ptrs, T + t, ALIGNED) + offs, mask=mask, other=0.0)
    tl.store(partial + tl.program_id(0), tl.sum(g * g))


@triton.jit
def adamw_kernel(ptrs, numels, wds, block_tensor, block_start, scale_ptr, found_inf_ptr, T, lr,
                  beta1, beta2, eps, step_size, bc2_sqrt, BLOCK: tl.constexpr,
                  ALIGNED: tl.constexpr, CASTS: tl.constexpr, SKIPPABLE: tl.constexpr,
                  INTERPRETED: tl.constexpr):  # fmt: skip
    """One AdamW update of one block (module docstring); step_size = lr / (1 - beta1^t),
    bc2_sqrt = sqrt(1 - beta2^t). CASTS: 0 none, 1 bf16, 2 fp16 casts written (row 4).
    SKIPPABLE: nothing is read or written where found_inf_ptr holds a non-zero."""
    t, offs, mask = _locate(block_tensor, block_start, numels, BLOCK, ALIGNED)
    if SKIPPABLE:  # the flag broadcast over the block (a scalar & a block fails interpreted)
        mask = mask & (tl.zeros([BLOCK], tl.float32) + tl.load(found_inf_ptr) == 0.0)
    p_ptr = _address(ptrs, t, ALIGNED) + offs
    m_ptr = _address(ptrs, 2 * T + t, ALIGNED) + offs
    v_ptr = _address(ptrs, 3 * T + t, ALIGNED) + offs
    g = tl.load(_address(ptrs, T + t, ALIGNED) + offs, mask=mask) / tl.load(scale_ptr)
    m = tl.load(m_ptr, mask=mask)
    v = tl.load(v_ptr, mask=mask)
    p = tl.load(p_ptr, mask=mask) * (1.0 - lr * tl.load(wds + t))
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(m_ptr, m, mask=mask)
    tl.store(v_ptr, v, mask=mask)
    tl.store(p_ptr, p, mask=mask)
    if CASTS != 0:  # row 4 of ptrs: the cast's address, 0 for a parameter without one
        c = tl.load(ptrs + 4 * T + t)
        if c != 0:
            if CASTS == 1:
                c_ptr = c.to(tl.pointer_type(tl.bfloat16))
            else:
                c_ptr = c.to(tl.pointer_type(tl.float16))
            if ALIGNED:
                c_ptr = tl.multiple_of(c_ptr, 16)
            tl.store(c_ptr + offs, to_dtype(p, c_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def _device_tensor(values, dtype, device):
    """A small table on `device` without a host sync (pinned memory, asynchronous copy)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class MultiTensorAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update for fp32 parameters, in one Triton launch per step.

    Takes what AdamW takes, but lr, betas and eps must be the same in every group (weight decay
    may differ). `grad_scale`, when set to a device scalar, divides every grad (the clip; as
    torch's fused AdamW's grad_scale). `found_inf`, a device scalar, skips the step where it is
    non-zero (module docstring). Parameters must be fp32, on one device, dense grads;
    those without a grad are skipped, as AdamW skips them. Not for amsgrad/maximize."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.grad_scale = self.found_inf = None
        self.weight_casts = {}  # param -> its cast to the compute dtype, written each step
        self._blocks = {}  # (numel, ...) -> (block_tensor, block_start) on the device
        self._tables = None  # (key of addresses, ptrs, numels, wds, aligned) of the last step

    def set_weight_casts(self, casts):
        """From now on each step also writes every parameter's new value, rounded to nearest,
        into casts[param]: contiguous, the parameter's shape, all bf16 or all fp16. Whoever
        reads them must start from copies of the current values (weight_casts.py does)."""
        dtypes = {c.dtype for c in casts.values()}
        if not dtypes <= set(CAST_CODES) or len(dtypes) > 1:
            raise TypeError(f"MultiTensorAdamW: casts must be all bf16 or all fp16, got {dtypes}")
        for p, c in casts.items():
            if c.shape != p.shape or not c.is_contiguous() or c.device != p.device:
                raise ValueError("MultiTensorAdamW: a cast must be contiguous, shaped and placed "
                                 "as its parameter")  # fmt: skip
        self.weight_casts = dict(casts)

    def _hyper(self):
        """(lr, betas, eps), the same in every group (only the weight decay is per tensor)."""
        found = {(g["lr"], tuple(g["betas"]), g["eps"]) for g in self.param_groups}
        if len(found) > 1:
            raise ValueError("MultiTensorAdamW: lr, betas and eps must match across groups")
        return found.pop()

    def _live(self):
        """(param, weight decay) of every parameter with a grad, state created where missing."""
        live = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if live and p.device != live[0][0].device:
                    raise ValueError("MultiTensorAdamW takes parameters on one device")
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32 or p.grad.is_sparse:
                    raise TypeError("MultiTensorAdamW takes fp32 parameters with dense fp32 grads")
                if not p.is_contiguous() or not p.grad.is_contiguous():
                    raise ValueError("MultiTensorAdamW takes contiguous parameters and grads")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                live.append((p, group["weight_decay"]))
        return live

    def _prepare(self, live):
        """The address and block tables of these parameters (rebuilt only when an address,
        i.e. a grad's allocation, changes)."""
        device = live[0][0].device
        numels = tuple(p.numel() for p, _ in live)
        if numels not in self._blocks:
            tensor_ids, starts = [], []
            for i, n in enumerate(numels):
                count = triton.cdiv(n, BLOCK)
                tensor_ids += [i] * count
                starts += range(0, count * BLOCK, BLOCK)
            self._blocks[numels] = (
                _device_tensor(tensor_ids, torch.int32, device),
                _device_tensor(starts, torch.int64, device),
            )
        ptrs = [p.data_ptr() for p, _ in live] + [p.grad.data_ptr() for p, _ in live]
        ptrs += [self.state[p]["exp_avg"].data_ptr() for p, _ in live]
        ptrs += [self.state[p]["exp_avg_sq"].data_ptr() for p, _ in live]
        if self.weight_casts:
            casts = self.weight_casts
            ptrs += [casts[p].data_ptr() if p in casts else 0 for p, _ in live]
        key = (tuple(ptrs), tuple(wd for _, wd in live))
        if self._tables is None or self._tables[0] != key:
            self._tables = (
                key,
                _device_tensor(ptrs, torch.int64, device),
                _device_tensor(numels, torch.int64, device),
                _device_tensor([wd for _, wd in live], torch.float32, device),
                all(n % 4 == 0 for n in numels) and all(a % 16 == 0 for a in ptrs),
            )
        return self._tables[1:] + self._blocks[numels]

    def state_dict(self):
        """AdamW's state dict; each parameter gets its own copy of the shared step counter, as
        torch's AdamW (which counts in place, per parameter) expects when it loads one."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v, step=v["step"].clone()) for k, v in sd["state"].items()}
        return sd

    def total_norm(self):
        """The L2 norm of all grads together, a device scalar (no host sync)."""
        live = self._live()
        if not live:
            return torch.zeros((), device=self.param_groups[0]["params"][0].device)
        ptrs, numels, _, aligned, block_tensor, block_start = self._prepare(live)
        partial = torch.empty(block_tensor.numel(), device=ptrs.device, dtype=torch.float32)
        sumsq_kernel[(block_tensor.numel(),)](
            ptrs, numels, block_tensor, block_start, partial, len(live), BLOCK=BLOCK,
            ALIGNED=aligned, num_warps=NUM_WARPS,
        )  # fmt: skip
        return partial.sum().sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        live = self._live()
        if not live:
            return loss
        lr, (beta1, beta2), eps = self._hyper()
        steps = [self.state[p]["step"] for p, _ in live]
        shared = steps[0]
        if shared.device.type != "cpu" or any(s is not shared for s in steps):
            # one CPU counter for all (reading one on the GPU would sync every step); after a
            # load_state_dict each parameter has its own, equal in training: once
            shared = torch.tensor(float(shared))
            for p, _ in live:
                self.state[p]["step"] = shared
        shared += 1
        t = shared.item()  # a CPU tensor: no device sync
        ptrs, numels, wds, aligned, block_tensor, block_start = self._prepare(live)
        scale = self.grad_scale
        if scale is None:
            scale = torch.ones((), device=ptrs.device)
        found_inf, casts = self.found_inf, self.weight_casts
        adamw_kernel[(block_tensor.numel(),)](
            ptrs, numels, wds, block_tensor, block_start, scale,
            scale if found_inf is None else found_inf, len(live), lr, beta1, beta2, eps,
            lr / (1 - beta1**t), (1 - beta2**t) ** 0.5, BLOCK=BLOCK, ALIGNED=aligned,
            CASTS=CAST_CODES[next(iter(casts.values())).dtype] if casts else 0,
            SKIPPABLE=found_inf is not None, INTERPRETED=ptrs.device.type != "cuda",
            num_warps=NUM_WARPS,
        )  # fmt: skip
        return loss


def adamw_reference(params, grads, exp_avgs, exp_avg_sqs, step, *, lr, betas, eps, weight_decays,
                    grad_scale=None, weight_casts=None):  # fmt: skip
    """One MultiTensorAdamW update in plain torch, in place on params, exp_avgs, exp_avg_sqs
    (lists of fp32 tensors), in the kernel's order of operations; step: t, the count after this
    update; weight_decays: one per tensor; grad_scale: None or the scalar every grad is divided
    by; weight_casts: None or one tensor (or None) per param, given the new value's cast."""
    beta1, beta2 = betas
    step_size, bc2_sqrt = lr / (1 - beta1**step), (1 - beta2**step) ** 0.5
    for p, g, m, v, wd in zip(params, grads, exp_avgs, exp_avg_sqs, weight_decays, strict=True):
        g = g if grad_scale is None else g / grad_scale
        p.mul_(1.0 - lr * wd)
        m.copy_(beta1 * m + (1.0 - beta1) * g)
        v.copy_(beta2 * v + (1.0 - beta2) * g * g)
        p.sub_(step_size * m / (v.sqrt() / bc2_sqrt + eps))
    for p, c in zip(params, weight_casts or [None] * len(params), strict=True):
        if c is not None:
            c.copy_(p)


def total_norm_reference(grads):
    """MultiTensorAdamW.total_norm in plain torch: the L2 norm of all grads together."""
    return torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
