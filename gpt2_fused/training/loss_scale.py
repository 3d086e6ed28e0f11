"""Dynamic loss scaling for float16 autocast (GPUs without bf16: T4, V100).

fp16 has 5 exponent bits: an activation's gradient under 6e-8 flushes to zero, one over 65504
overflows. So the backward runs on loss * scale, which lifts the gradients into fp16's range; the
fp32 weight grads come out scaled and the update divides them again. A step whose grads hold an
inf or a nan is skipped whole (the weights, AdamW's moments and the kept casts untouched) and the
scale halves; after GROWTH_INTERVAL clean steps in a row it doubles. These are torch.amp.
GradScaler's rule and defaults, and torch._amp_update_scale_ is its kernel.

Unlike GradScaler's step, nothing here reads the GPU: the grad norm of the scaled grads (which
the clip computes anyway) is non-finite exactly when a grad is, found_inf is formed from it on the
device, and the update skips on the device (the Triton AdamW masks every load and store, torch's
fused AdamW takes found_inf as GradScaler gives it). The one-step-late stats (runlog.StepStats)
carry the skip and the scale to the log. Only the CPU's unfused AdamW reads found_inf on the host
(a CPU has nothing to overlap).

The scale, its growth count and the skipped steps are checkpointed under "loss_scale"; a bf16 or
fp32 run's checkpoint has none, and an fp16 run resumed from one starts at INIT_SCALE.
"""

import torch

from gpt2_fused.training.config import ConfigError

INIT_SCALE = 2.0**16
GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0, 0.5, 2000


class LossScaler:
    """The loss scale of an fp16 run, on the device; disabled (scale 1, nothing skipped) for any
    other dtype, where every method but scaled() and stats() does nothing."""

    def __init__(self, device, enabled):
        self.enabled = enabled
        self.scale = torch.full((), INIT_SCALE if enabled else 1.0, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((), device=device)  # the last step's: 1.0 when skipped
        self.skipped = torch.zeros((), device=device)  # steps skipped since the run began

    @classmethod
    def for_run(cls, cfg, dtype, device):
        """The run's LossScaler, enabled for float16; ConfigError for what float16 does not run
        with."""
        if dtype == torch.float16 and cfg.model.fp8 != "off":
            raise ConfigError(
                f"fp8={cfg.model.fp8!r} with dtype float16: the FP8 GEMMs read and write bf16 "
                "(every GPU with FP8 has bf16); pass --dtype=bfloat16, or --fp8='off'"
            )
        if dtype == torch.float16 and cfg.shard == "full":
            raise ConfigError(
                "shard='full' with dtype float16: the loss scale's skipped steps are not wired "
                "into FSDP2's sharded update; pass --shard=optimizer (ZeRO-1), or --dtype=float32"
            )
        return cls(device, enabled=dtype == torch.float16)

    def scaled(self, loss):
        return loss * self.scale if self.enabled else loss

    def check(self, scaled_norm):
        """Set found_inf from the norm of the scaled grads; returns the true norm."""
        if not self.enabled:
            return scaled_norm
        torch.logical_not(torch.isfinite(scaled_norm), out=self.found_inf)
        self.skipped += self.found_inf
        return scaled_norm.float() / self.scale

    def update(self):
        """After the step: the scale halves if it was skipped, doubles after GROWTH_INTERVAL
        clean ones."""
        if not self.enabled:
            return
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            self.found_inf,
            GROWTH_FACTOR,
            BACKOFF_FACTOR,
            GROWTH_INTERVAL,
        )

    def stats(self):
        """[skipped (1.0) or not, steps skipped so far, the scale]: device scalars for the step's
        stats (runlog.StepStats), stacked before update(), so the scale is the step's own; []
        when disabled."""
        return [self.found_inf, self.skipped, self.scale] if self.enabled else []

    def checkpoint(self):
        """The checkpoint's entry: {"loss_scale": state_dict()}, or {} when disabled."""
        return {"loss_scale": self.state_dict()} if self.enabled else {}

    def state_dict(self):
        return {
            "scale": self.scale.item(),
            "growth_tracker": int(self.growth_tracker.item()),
            "skipped": int(self.skipped.item()),
        }

    def load_state_dict(self, state):
        self.scale.fill_(state["scale"])
        self.growth_tracker.fill_(state["growth_tracker"])
        self.skipped.fill_(state["skipped"])

    def resume(self, ckpt, notes):
        """Restore the checkpoint's scale when both runs scale their loss; a note otherwise."""
        state = ckpt.get("loss_scale")
        if self.enabled and state is not None:
            self.load_state_dict(state)
        elif self.enabled:
            notes.append(
                f"the checkpoint has no loss scale (not a float16 run's): it starts at "
                f"{INIT_SCALE:g}"
            )
        elif state is not None:
            notes.append("the checkpoint's float16 loss scale is not used: this run is not fp16")
