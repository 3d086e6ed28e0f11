"""Distributed data loading from llm.c token shards, in a seeded order that changes every epoch.

A shard of n tokens holds (n-1)//T windows of T+1 tokens at stride T: window i is
tokens[i*T : i*T+T+1], and one batch row is x = window[:-1], y = window[1:]. Epoch e visits the
shards in a permuted order and each shard's windows in a permuted order (llm.c's dataloader.h
permutes shards and samples the same way), from numpy generators seeded with (seed, e, 0) and
(seed, e, 1 + shard index). A step takes the next B*W windows of the shard's order, rank r of W
the B starting at `window + r*B`. When fewer than B*W are left (that tail is skipped: other
windows each epoch), the loader goes on to the next shard of the order, and after the last one to
epoch e+1. So in an epoch no window comes twice, and the ranks' windows are disjoint and together
cover all but the tails. The orders depend on (seed, e, T, the shards), not on B or W. With
shuffle=False both orders are the identity, and B consecutive windows are B*T+1 contiguous
tokens: the sequential order this loader had before it shuffled.

The state (epoch, shard index in the epoch's order, window index in the shard's order) is the
same on every rank, so rank 0's `state_dict()` resumes every rank exactly; the orders are
recomputed from the seed, never stored. Resumed with another B or world size, the run continues
at the same window: nothing is repeated or skipped, only where a shard's tail begins moves.
Memory: one int32 per window of the open shard; the tokens stay a read-only memmap.
"""

import glob
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from numpy.lib.stride_tricks import as_strided

from data import resolve_dataset
from data.shards import DataError, read_header, read_shard
from gpt2_fused.training.config import ConfigError

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


def _windows(tokens, T):
    """(n_windows, T+1) read-only view of a shard's tokens: row i = tokens[i*T : i*T+T+1]."""
    n = (len(tokens) - 1) // T if len(tokens) else 0
    step = tokens.strides[0]
    return as_strided(tokens, shape=(n, T + 1), strides=(T * step, step), writeable=False)


def _order(n, shuffle, *seed):
    """0..n-1 as int32, permuted by a generator seeded with `seed` when shuffling."""
    order = np.arange(n, dtype=np.int32)
    if shuffle:
        np.random.default_rng(list(seed)).shuffle(order)
    return order


class _Transfer:
    """(B, T+1) uint16 windows -> x, y: (B, T) int64 tensors on `device`, both contiguous.

    x and y are the two halves of one (2, B, T) buffer. On CUDA it is filled in one of two pinned
    host buffers and copied non-blocking; an event per buffer makes sure its previous copy finished
    before the buffer is overwritten.
    """

    def __init__(self, B, T, device):
        self.shape = (2, B, T)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.host = [
                torch.empty(self.shape, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
            self.events = [None, None]
            self.i = 0

    def __call__(self, rows):
        if not self.cuda:
            buf = torch.empty(self.shape, dtype=torch.int64)
            _fill(buf.numpy(), rows)
            return buf[0], buf[1]
        i = self.i = 1 - self.i
        if self.events[i] is not None:
            self.events[i].synchronize()
        _fill(self.host[i].numpy(), rows)
        buf = self.host[i].to(self.device, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record(torch.cuda.current_stream(self.device))  # the copy's stream
        return buf[0], buf[1]


def _fill(out, rows):
    """out: (2, B, T) int64 <- x, y of rows: (B, T+1) uint16."""
    np.copyto(out[0], rows[:, :-1], casting="safe")
    np.copyto(out[1], rows[:, 1:], casting="safe")


class DataLoader:
    """Endless (B, T) int64 batches (x, y) for one rank, in an order shuffled anew each epoch
    (or, with shuffle=False, rank-strided through the shards in order)."""

    def __init__(self, pattern, B, T, rank=0, world_size=1, device="cpu", shuffle=True, seed=0):
        _check_layout(B, T, rank, world_size)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.files = _shard_paths(pattern)
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.shuffle, self.seed = bool(shuffle), seed
        self.step_windows = B * world_size  # windows consumed per step by all ranks together
        self.ntoks = [read_header(f) for f in self.files]  # validates every header up front
        for f, n in zip(self.files, self.ntoks, strict=True):
            if n < B * T * world_size + 1:
                raise ValueError(
                    f"{f}: {n} tokens is too small for one step of batch_size*block_size*"
                    f"world_size+1 = {B}*{T}*{world_size}+1 = {B * T * world_size + 1} tokens: "
                    "lower --batch_size, or prepare bigger shards"
                )
        self._transfer = _Transfer(B, T, device)
        self.reset()

    def reset(self):
        """Back to the start of epoch 0."""
        self._open(0, 0, 0)

    def _shard_order(self, epoch):
        return _order(len(self.files), self.shuffle, self.seed, epoch, 0)

    def _open(self, epoch, shard, window):
        """Go to window `window` of the shard at index `shard` of epoch `epoch`'s shard order."""
        self.epoch, self.shard, self.window = epoch, shard, window
        self.file = int(self._shard_order(epoch)[shard])  # index into self.files
        self.windows = _windows(read_shard(self.files[self.file]), self.T)  # a view: no copy
        # this epoch's window order in this shard: (n_windows,) int32, the loader's only array
        self.order = _order(len(self.windows), self.shuffle, self.seed, epoch, 1 + self.file)

    def next_batch(self):
        """The next (x, y), each (B, T) int64 on the loader's device; y is x shifted by one."""
        if self.window + self.step_windows > len(self.windows):
            shard = self.shard + 1
            if shard == len(self.files):
                self._open(self.epoch + 1, 0, 0)
            else:
                self._open(self.epoch, shard, 0)
        first = self.window + self.rank * self.B
        rows = self.windows[self.order[first : first + self.B]]  # (B, T+1) uint16, gathered
        self.window += self.step_windows
        return self._transfer(rows)

    def state_dict(self):
        """Where the next batch comes from (same on every rank), plus names to check on reload."""
        return {
            "epoch": self.epoch,
            "shard": self.shard,  # index in the epoch's shard order
            "window": self.window,  # index in that shard's window order
            "shuffle": self.shuffle,
            "seed": self.seed,
            "T": self.T,
            "shard_name": Path(self.files[self.file]).name,
            "num_shards": len(self.files),
        }

    def load_state_dict(self, state):
        """Continue exactly where `state_dict()` was taken (same shards and T; B, W may differ).

        The state's order wins over the loader's own shuffle and seed, so that a run goes on in
        the order it began with: a state from before the loader shuffled (no "shuffle" key, a
        token "position") continues sequentially. Returns a one-line notice when that order is
        not the one this loader was made with, else None.
        """
        if state.get("num_shards", len(self.files)) != len(self.files):
            raise ValueError(
                f"loader state is for {state['num_shards']} shards, "
                f"this loader has {len(self.files)}"
            )
        epoch, shard = int(state["epoch"]), int(state["shard"])
        if not 0 <= shard < len(self.files):
            raise ValueError(f"loader state names shard {shard}, only {len(self.files)} exist")
        if "shuffle" in state:  # "window": an index into the shard's window order
            shuffle, seed, T = bool(state["shuffle"]), int(state["seed"]), int(state["T"])
            window, position = int(state["window"]), None
            if T != self.T and shuffle:
                raise ValueError(
                    f"loader state is for T={T}, this loader has T={self.T}: a shuffled order "
                    "of windows of another length cannot be continued"
                )
            if T != self.T:
                position = window * T  # sequential: the same token offset, in windows of self.T
        else:  # from before the loader shuffled: a token offset into the sequential order
            shuffle, seed, position = False, self.seed, int(state["position"])
        note = None
        if "shuffle" not in state and self.shuffle:
            note = "loader state predates shuffling: this run continues in its sequential order"
        elif shuffle != self.shuffle or (shuffle and seed != self.seed):
            note = f"loader state has shuffle={shuffle}, seed={seed}: this run continues that order"
        self.shuffle, self.seed = shuffle, seed
        f = int(self._shard_order(epoch)[shard])
        name = Path(self.files[f]).name
        if state.get("shard_name", name) != name:
            raise ValueError(
                f"loader state was taken in shard {state['shard_name']}, "
                f"but shard {shard} is {name}"
            )
        if position is not None:
            if not 0 <= position <= self.ntoks[f]:
                raise ValueError(f"loader state position {position} is outside {name}")
            window = -(-position // self.T)  # the next whole window: fewer than T tokens skipped
        elif not 0 <= window <= (self.ntoks[f] - 1) // self.T:
            raise ValueError(f"loader state window {window} is outside {name}")
        self._open(epoch, shard, window)
        return note


def iter_val_batches(pattern, B, T, rank=0, world_size=1, max_tokens=VAL_TOKENS, device="cpu"):
    """Yield this rank's (x, y) batches of a fixed validation pass, the same on every call.

    Never shuffled. The pass covers min(max_tokens, what the shards hold) rounded down to whole
    steps of B*T*W tokens; step s of a shard gives rank r the B*T+1 tokens at s*B*T*W + r*B*T, so
    ranks split the budget evenly and all ranks yield the same number of batches.
    """
    _check_layout(B, T, rank, world_size)
    files = _shard_paths(pattern)
    # a pass smaller than one micro-batch (batch_size="auto" may pick 64) takes fewer rows a batch
    B = max(1, min(B, max_tokens // (T * world_size)))
    step_tokens = B * T * world_size
    steps_left = max_tokens // step_tokens
    per_shard = [(f, (read_header(f) - 1) // step_tokens) for f in files]
    step = f"one validation step of batch_size*block_size*world_size = {B}*{T}*{world_size}"
    if steps_left == 0:  # max_tokens is train.py's val_tokens: a setting out of range, exit 2
        raise ConfigError(
            f"val_tokens={max_tokens} is less than {step} = {step_tokens} tokens: pass "
            f"--val_tokens={step_tokens} or more"
        )
    if sum(n for _, n in per_shard) == 0:
        most = max(read_header(f) for f in files)
        raise ValueError(
            f"the validation shards {files} hold at most {most} tokens each, fewer than {step} "
            f"+ 1 = {step_tokens + 1}: prepare a bigger validation set (python -m data.fineweb "
            "--val-tokens N or --val-from FILES), or lower --batch_size"
        )
    transfer = _Transfer(B, T, device)
    for f, steps in per_shard:
        if steps_left == 0:
            return
        windows = _windows(read_shard(f), T)
        for s in range(min(steps, steps_left)):
            first = s * B * world_size + rank * B  # this rank's B consecutive windows
            yield transfer(windows[first : first + B])
        steps_left -= min(steps, steps_left)


def open_data(cfg, train_loader, procs):
    """(train_loader(...), train_glob, val_glob) for a run's cfg (a TrainConfig) on procs (its
    processes, gpt2_fused/training/distributed.py); a problem with the data raises
    DataError naming the file. Checked here: every shard's header, the token ids of the val
    shards and of the train shard read first (the loader checks each other one when it opens
    it), and that a step fits in each shard. One process per node goes first: "embedded" is
    prepared on first use."""
    B, T, rank, world_size = cfg.batch_size, cfg.model.block_size, procs.rank, procs.world_size
    try:
        if procs.local_rank == 0:
            train_glob, val_glob = resolve_dataset(cfg.dataset)
        if procs.ddp:
            dist.barrier()
        if procs.local_rank != 0:
            train_glob, val_glob = resolve_dataset(cfg.dataset)
        order = dict(shuffle=cfg.shuffle, seed=cfg.seed)
        loader = train_loader(train_glob, B, T, rank, world_size, device=procs.device, **order)
        for path in sorted(glob.glob(val_glob)):
            read_shard(path)
        val = iter_val_batches(val_glob, B, T, rank, world_size, cfg.val_tokens, procs.device)
        next(val)
    except (DataError, ConfigError):
        raise
    except (FileNotFoundError, ValueError) as e:  # resolve_dataset's and the loader's name the file
        raise DataError(str(e)) from e
    return loader, train_glob, val_glob
