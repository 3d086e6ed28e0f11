"""One process per GPU under torchrun (or a single process): set-up, rank-0 printing, teardown."""

import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpt2_fused.training.hardware import keep_freed_memory, pick_device


@dataclass
class Processes:
    ddp: bool  # under torchrun, with a process group
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def master(self):
        return self.rank == 0


def setup(device_name="auto"):
    """This process's rank and device; under torchrun (RANK, WORLD_SIZE set) also the process
    group (NCCL on CUDA, gloo on CPU), each process on the GPU of its LOCAL_RANK. ValueError for
    a device that is not there."""
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank if ddp else (device.index or 0))
        torch.cuda.set_device(device)
    elif device.type == "cpu":
        keep_freed_memory()
    if ddp:
        backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
        dist.init_process_group(backend=backend, device_id=device_id)
    return Processes(ddp, rank, local_rank, world_size, device)


def teardown(procs, finished):
    """Destroy the process group. NCCL only after a clean end (`finished`): after an exception on
    one rank the others may be inside a collective, where destroying NCCL communicators can hang;
    torchrun then ends them. Gloo's destroy is local, and leaving its threads to interpreter exit
    can abort it; after a clean end every rank first waits for the others, so that none closes
    its gloo connections while another still uses them."""
    if not (procs.ddp and dist.is_initialized()):
        return
    if finished:
        dist.barrier()
        dist.destroy_process_group()
        if procs.device.type != "cuda":
            # gloo's worker thread frees the barrier's work, and the earlier works it holds,
            # after the barrier returns; freeing their tensors takes the GIL. The group's
            # destructor joins that thread, later, from a dealloc that holds the GIL: a hang
            # (4 in 10 runs of --shard=optimizer on 3 ranks). Sleeping hands the thread the GIL
            time.sleep(0.1)
    elif procs.device.type != "cuda":
        dist.destroy_process_group()


def exit_if_launched():
    """Under torchrun, after main() ended cleanly (process group destroyed, files closed): leave
    at once, without the interpreter's finalisation, where gloo's threads can still abort the
    process ("terminate called without an active exception", one run in ten on a loaded 2-core
    machine) and turn a finished run into a failed one. Unwritable output is dropped."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: nothing more to say
            pass
    os._exit(0)


def say(*args):
    """print(*args), flushed. Output that cannot be written (stdout a pipe whose reader has gone,
    as when the Ctrl-C that stops a run also ends its `| tee`) is dropped: stdout then goes to
    /dev/null, so that the run, its checkpoint and the flush at exit go on."""
    try:
        print(*args, flush=True)
    except OSError:
        try:
            fd = sys.stdout.fileno()
        except (OSError, ValueError):  # not a file (a capture): nothing to redirect
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


def printer(procs):
    """print0: say() on rank 0, nothing elsewhere."""

    def print0(*args):
        if procs.master:
            say(*args)

    return print0
