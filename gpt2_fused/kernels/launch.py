"""What the kernels' launches ask of the GPU (its SM count, its compute capability), and a LAUNCH
table's entries overridden for a block of code.

Here, in the lowest layer, so that fused_loss/ and the kernels beside this module share one copy
(gpt2_fused/training/hardware.py, which picks a run's device, sits above fused_loss and so cannot
serve it). Nothing here queries a device at import.
"""

import contextlib
import functools
import os

import torch


@functools.cache  # asked at every launch; the count of a device does not change
def num_sms(device_index):
    """Streaming multiprocessors of CUDA device `device_index` (None: the current one).

    Cached, so Dynamo would re-trace it at every call: call it from launchers that torch.compile
    does not enter (custom ops), never from a traced forward (tests/test_compile_graph.py).
    """
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# "8.6": every capability check of this package reports sm_86, whatever the GPU (tests and bench
# run the non-Hopper paths on an H100 with it). Read at each call, not at import
FORCE_CAPABILITY = "GPT2_FUSED_FORCE_CAPABILITY"


def capability(device=None):
    """(major, minor) compute capability of CUDA device `device` (None: the current one), or what
    GPT2_FUSED_FORCE_CAPABILITY says ("8.6" -> (8, 6)). Not cached: torch caches the
    properties, and a test may change the variable."""
    forced = os.environ.get(FORCE_CAPABILITY)
    if forced:
        try:
            major, minor = (int(v) for v in forced.split("."))
        except ValueError:
            raise ValueError(f"{FORCE_CAPABILITY}={forced!r}: give major.minor, e.g. 8.6") from None
        return major, minor
    return tuple(torch.cuda.get_device_capability(device))


@contextlib.contextmanager
def launch_overrides(table, **entries):
    """`table` (one device's LAUNCH dict of a kernel module) with `entries` in place of its values
    for the block, restored after, raise or not. A key the table does not have is a KeyError (a
    typo would otherwise time the defaults). For benchmarks of other launches: the kernels read
    their table at each call, and their custom ops' schemas take no launch settings. The table is
    the process's own: not for concurrent use."""
    unknown = sorted(set(entries) - set(table))
    if unknown:
        raise KeyError(f"launch settings {unknown} are not among {sorted(table)}")
    saved = dict(table)
    table.update(entries)
    try:
        yield table
    finally:
        table.clear()
        table.update(saved)
