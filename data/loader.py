"""Distributed data loading from llm.c token shards.

Each step, rank r of W takes the B*T+1 contiguous tokens starting at `position + r*B*T` of the
current shard: x = buf[:-1].view(B, T), y = buf[1:].view(B, T). `position` then advances by B*T*W,
so the ranks read disjoint consecutive blocks. When the next step would run past the shard's end
(the tail, fewer than B*T*W+1 tokens, is skipped), the loader moves to the next shard, and from the
last shard back to the first, counting an epoch. The order depends only on (shards, B, T, W): there
is no randomness.

The position is shared by all ranks, so rank 0's `state_dict()` resumes every rank exactly.
"""

import glob
from pathlib import Path

import numpy as np
import torch

from data.shards import read_header, read_shard

VAL_TOKENS = 10_485_760  # 10 * 2**20, the llm.c / modded-nanogpt validation budget


def _shard_paths(pattern):
    """Sorted shard paths from a glob string or an explicit list."""
    if isinstance(pattern, (str, Path)):
        paths = sorted(glob.glob(str(pattern)))
        if not paths:
            raise FileNotFoundError(f"no shard files match {pattern}")
    else:
        paths = [str(p) for p in pattern]
        if not paths:
            raise ValueError("empty list of shard files")
    return paths


def _check_layout(B, T, rank, world_size):
    for name, v in (("B", B), ("T", T), ("world_size", world_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")


class _Transfer:
    """uint16 windows -> int64 tensors on `device`.

    On CUDA the window is widened into one of two pinned host buffers and copied non-blocking; an
    event per buffer makes sure its previous copy finished before the buffer is overwritten.
    """

    def __init__(self, n, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.host = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self.events = [None, None]
            self.i = 0

    def __call__(self, window, B, T):
        if not self.cuda:
            buf = torch.from_numpy(window.astype(np.int64))
        else:
            i = self.i = 1 - self.i
            if self.events[i] is not None:
                self.events[i].synchronize()
            np.copyto(self.host[i].numpy(), window, casting="safe")
            buf = self.host[i].to(self.device, non_blocking=True)
            self.events[i] = torch.cuda.Event()
            self.events[i].record(torch.cuda.current_stream(self.device))  # the copy's stream
        return buf[:-1].view(B, T), buf[1:].view(B, T)


class DataLoader:
    """Endless (B, T) int64 batches (x, y) for one rank, rank-strided through shards in order."""

    def __init__(self, pattern, B, T, rank=0, world_size=1, device="cpu"):
        _check_layout(B, T, rank, world_size)
        self.files = _shard_paths(pattern)
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.step_tokens = B * T * world_size  # tokens consumed per step by all ranks together
        self.ntoks = [read_header(f) for f in self.files]  # validates every header up front
        for f, n in zip(self.files, self.ntoks, strict=True):
            if n < self.step_tokens + 1:
                raise ValueError(
                    f"{f}: {n} tokens is too small for one step of B*T*world_size+1 = "
                    f"{B}*{T}*{world_size}+1 = {self.step_tokens + 1} tokens"
                )
        self._transfer = _Transfer(B * T + 1, device)
        self.reset()

    def reset(self):
        """Back to the start of the first shard, epoch 0."""
        self.epoch = 0
        self._open(0, 0)

    def _open(self, shard, position):
        self.shard = shard
        self.position = position  # start of rank 0's window in the current shard
        self.tokens = read_shard(self.files[shard])

    def _fits(self):
        return self.position + self.step_tokens + 1 <= self.ntoks[self.shard]

    def next_batch(self):
        """The next (x, y), each (B, T) int64 on the loader's device; y is x shifted by one."""
        if not self._fits():
            nxt = (self.shard + 1) % len(self.files)
            if nxt == 0:
                self.epoch += 1
            self._open(nxt, 0)
        start = self.position + self.rank * self.B * self.T
        window = self.tokens[start : start + self.B * self.T + 1]
        self.position += self.step_tokens
        return self._transfer(window, self.B, self.T)

    def state_dict(self):
        """Where the next batch comes from (same on every rank), plus names to check on reload."""
        return {
            "shard": self.shard,
            "position": self.position,
            "epoch": self.epoch,
            "shard_name": Path(self.files[self.shard]).name,
            "num_shards": len(self.files),
        }

    def load_state_dict(self, state):
        """Continue exactly where `state_dict()` was taken (same shards; B, T, W may differ)."""
        shard, position = int(state["shard"]), int(state["position"])
        if state.get("num_shards", len(self.files)) != len(self.files):
            raise ValueError(
                f"loader state is for {state['num_shards']} shards, "
                f"this loader has {len(self.files)}"
            )
        if not 0 <= shard < len(self.files):
            raise ValueError(f"loader state names shard {shard}, only {len(self.files)} exist")
        name = Path(self.files[shard]).name
        if state.get("shard_name", name) != name:
            raise ValueError(
                f"loader state was taken in shard {state['shard_name']}, "
                f"but shard {shard} is {name}"
            )
        if not 0 <= position <= self.ntoks[shard]:
            raise ValueError(f"loader state position {position} is outside {name}")
        self.epoch = int(state["epoch"])
        self._open(shard, position)


def iter_val_batches(pattern, B, T, rank=0, world_size=1, max_tokens=VAL_TOKENS, device="cpu"):
    """Yield this rank's (x, y) batches of a fixed validation pass, the same on every call.

    The pass covers min(max_tokens, what the shards hold) rounded down to whole steps of B*T*W
    tokens; step s of a shard gives rank r the window at s*B*T*W + r*B*T, so ranks split the budget
    evenly and all ranks yield the same number of batches.
    """
    _check_layout(B, T, rank, world_size)
    files = _shard_paths(pattern)
    step_tokens = B * T * world_size
    steps_left = max_tokens // step_tokens
    per_shard = [(f, (read_header(f) - 1) // step_tokens) for f in files]
    if sum(n for _, n in per_shard) == 0 or steps_left == 0:
        raise ValueError(
            f"validation shards {files} ({sum(read_header(f) for f in files)} tokens) or "
            f"max_tokens={max_tokens} are too small for one step of B*T*world_size+1 = "
            f"{step_tokens + 1} tokens"
        )
    transfer = _Transfer(B * T + 1, device)
    for f, steps in per_shard:
        if steps_left == 0:
            return
        tokens = read_shard(f)
        for s in range(min(steps, steps_left)):
            start = s * step_tokens + rank * B * T
            yield transfer(tokens[start : start + B * T + 1], B, T)
        steps_left -= min(steps, steps_left)
