"""A step's gradients kept in one flat buffer of their own: what a step recorded as CUDA graphs
needs to sum its micro-batches, and what a once-a-step all-reduce reads."""

import torch


class KeptGrads:
    """Every trainable parameter's .grad as a view into one flat buffer of its own (slots of 16
    bytes' multiples: adamw.py's wide loads), summed over a step's micro-batches; `flat` is what
    a step under torchrun all-reduces (data_parallel.DataParallel.sync_at_step).

    Why a buffer: under CUDA graphs autograd installs the backward graph's output as a
    parameter's first .grad, and the next micro-batch's replay writes over that memory, so the
    sum is lost (pytorch/pytorch#169545). by_grad (under graphs): the micro-batch's grads come
    from torch.autograd.grad, the graph's outputs, and one foreach op copies them in (the first
    micro-batch) or adds them (the rest): a few multi-tensor launches, where autograd's own
    accumulation adds each parameter's in a kernel of its own (148 at 124M) into a buffer that
    must be zeroed each step. Without graphs autograd accumulates in place: its grads are
    freed as they are added, where autograd.grad would hold them all at once (4 B/param)."""

    def __init__(self, model, by_grad):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if len({(p.dtype, p.device) for p in self.params}) != 1:
            raise ValueError("KeptGrads: the trainable parameters must share one dtype and device")
        slots = [(p.numel() + 3) // 4 * 4 for p in self.params]  # 4 elements: 16 B
        p0 = self.params[0]
        self.flat = torch.zeros(sum(slots), dtype=p0.dtype, device=p0.device)
        self.views, offset = [], 0
        for p, n in zip(self.params, slots, strict=True):
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            self.views.append(p.grad)
            offset += n
        self.by_grad = by_grad

    def backward(self, loss, first):
        """Add loss's gradients to the kept ones; first: the step's first micro-batch (its
        grads replace what the last step left)."""
        if not self.by_grad:
            loss.backward()
            return
        grads = torch.autograd.grad(loss, self.params, allow_unused=True, materialize_grads=True)
        if first:
            torch._foreach_copy_(self.views, grads)
        else:
            torch._foreach_add_(self.views, grads)

    def zero(self):
        """After the update: zeroed for autograd to add into (by_grad: the next step's first
        micro-batch overwrites them)."""
        if not self.by_grad:
            self.flat.zero_()
