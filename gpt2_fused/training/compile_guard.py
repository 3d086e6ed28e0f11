"""The guard that compares compiled and eager losses.

torch.compile has produced training steps with a wrong loss and gradients at 774M and 1558M
(bench/RESULTS.md#compile; compile_settings.py avoids the known case). The guard catches others:
on the first training micro-batch of the run and of the step after each evaluation, and on the
first batch of each evaluation, the compiled loss must be within COMPILE_CHECK_TOL of an eager
forward's on the same batch.
"""

import torch
import torch.distributed as dist

# nats. Right graphs are within 6e-5 of eager mode's loss at the first step (124M to 1558M); the
# wrong ones seen were 5e-3 to 4.6e-2 off
COMPILE_CHECK_TOL = 2e-3


class CompileMismatch(RuntimeError):
    pass


def compiled_loss_mismatch(compiled, eager, ddp, what):
    """None if every rank's compiled loss (0-dim tensor) is within COMPILE_CHECK_TOL of its eager
    loss on the same batch, else the message saying how far off (the same on every rank)."""
    pair = torch.stack([compiled.detach().float(), eager.detach().float()])
    gap = (pair[0] - pair[1]).abs().reshape(1)
    if ddp:
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    if gap.item() <= COMPILE_CHECK_TOL:  # NaN is a mismatch too
        return None
    compiled, eager = pair.tolist()
    return (
        f"the compiled model's loss on the {what} differs from eager mode's by "
        f"{gap.item():.2e} nats (here: compiled {compiled:.6f}, eager {eager:.6f}; allowed "
        f"{COMPILE_CHECK_TOL:g}): torch.compile has produced a wrong graph for this model"
    )


def check_training_step(first_loss, eager_loss, ddp, step):
    """Raise CompileMismatch if the compiled first micro-batch's loss is not eager mode's; called
    before the update, so that a wrong graph never touches the weights."""
    what = f"first training batch of step {step}"
    wrong = compiled_loss_mismatch(first_loss, eager_loss, ddp, what)
    if wrong:
        raise CompileMismatch(
            f"{wrong}. Try --buffer_reuse=none, another --activation_memory_budget, "
            "or --compile=False (bench/compile_check.py narrows it down); "
            "--check_compile=False skips this check"
        )
