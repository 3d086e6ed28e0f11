"""Checkpoint files: out_dir/ckpt_{step:07d}.pt, written atomically, loaded with weights_only=True.

A write goes to a temporary file that is fsynced and then renamed, so a crash leaves either the
old files or the complete new one; the newest `keep_last` are kept. A write that fails (a full
disk) removes its temporary file and raises CheckpointError, which names the file, the free space
and the size needed. A checkpoint that does not load (truncated, corrupt) raises CheckpointError
naming it; resuming falls back to the newest one that loads and keeps the others aside. torch.save
writes a zip whose records carry CRC-32s, which torch.load does not check: load_checkpoint checks
them first, so bytes changed on disk are caught too.
"""

import glob
import os
import pickle
import shutil
import zipfile
import zlib

import torch
import torch.distributed as dist

# what torch.load raised on 4,000 truncated or byte-flipped checkpoints, besides loading some of
# them (flipped tensor bytes, which _check_crcs catches): the zip reader RuntimeError; the unpickler
# UnpicklingError (weights_only refusing what it does not know), EOFError, KeyError, IndexError,
# TypeError, ValueError (UnicodeDecodeError); reads at damaged offsets OSError
_DAMAGED = (
    RuntimeError,
    pickle.UnpicklingError,
    EOFError,
    KeyError,
    IndexError,
    TypeError,
    ValueError,
    OSError,
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read, or that is not a checkpoint of this model;
    the message names the file."""


def list_checkpoints(out_dir):
    """Checkpoint paths in out_dir, oldest first (names are zero-padded, so sorting is by step)."""
    return sorted(glob.glob(os.path.join(out_dir, "ckpt_[0-9]*.pt")))


def save_checkpoint(obj, out_dir, step, keep_last):
    """Write out_dir/ckpt_{step:07d}.pt atomically, then delete all but the newest keep_last."""
    path = os.path.join(out_dir, f"ckpt_{step:07d}.pt")
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    # torch.save reports a failed write as RuntimeError("... unexpected pos ..."), the OSError
    # as its __context__
    except (OSError, RuntimeError) as e:
        _remove(tmp)
        raise CheckpointError(_write_failed(path, obj, e)) from e
    except BaseException:  # a second Ctrl-C, say: no half-written file either
        _remove(tmp)
        raise
    os.replace(tmp, path)  # a crash leaves either the old file set or the complete new file
    dir_fd = os.open(out_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    if keep_last > 0:
        for old in list_checkpoints(out_dir)[:-keep_last]:
            os.remove(old)
    return path


def newest_note(out_dir):
    """What a run that stops now without saving leaves behind, for its error message."""
    ckpts = list_checkpoints(out_dir)
    if not ckpts:
        return f"no checkpoint has been saved in {out_dir}"
    return f"the newest checkpoint, {ckpts[-1]}, is intact"


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _write_failed(path, obj, e):
    cause = e.__context__ if isinstance(e, RuntimeError) else e  # the OSError under torch's
    if not isinstance(cause, OSError):
        cause = e
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
    out_dir = os.path.dirname(path) or "."
    free = shutil.disk_usage(out_dir).free
    return (
        f"cannot write {path}: {reason} ({_size(free)} free in {out_dir}, the checkpoint needs "
        f"about {_size(_tensor_bytes(obj))}); {newest_note(out_dir)}"
    )


def _tensor_bytes(obj):
    """Bytes of the tensors in nested dicts and lists: about a checkpoint's size on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _size(nbytes):
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def load_checkpoint(path, map_location="cpu"):
    """torch.load(path, weights_only=True) after the zip's CRC-32 check; a file that does not load
    or fails the check raises CheckpointError naming it (a missing or unreadable one raises as it
    is)."""
    _check_crcs(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except _DAMAGED as e:
        first = str(e).strip().split("\n")[0].split(". ")[0][:200]  # torch's are paragraphs
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise CheckpointError(f"{path} does not load ({why}): truncated or corrupt") from e


def _check_crcs(path):
    """Read every record of torch.save's zip and compare it with its CRC-32 (a second read of the
    file, faster than torch.load's). A file that is no zip is left to torch.load, which names
    what is wrong."""
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):  # truncated, another format, missing: torch.load says
        return
    try:
        with z:
            bad = z.testzip()
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:  # a local header damaged
        raise CheckpointError(f"{path} does not load ({e}): truncated or corrupt") from e
    if bad is not None:
        raise CheckpointError(f"{path} does not load (record {bad} fails its CRC-32): corrupt")


def load_newest(out_dir, keys, warn):
    """(path, checkpoint) of the newest checkpoint in out_dir that loads and holds `keys`, or
    (None, None) when out_dir has none. Each newer one that does not is renamed to PATH.corrupt
    (kept for a look, out of the way of list_checkpoints and pruning), with a warning line through
    `warn`; when none loads, CheckpointError names them all and nothing is renamed. Temporary
    files of writes that never finished (a kill mid-write) are removed."""
    for tmp in glob.glob(os.path.join(out_dir, "ckpt_[0-9]*.pt.tmp")):
        os.remove(tmp)
        warn(f"removed {tmp}, a checkpoint write that did not finish")
    failed = []
    for path in reversed(list_checkpoints(out_dir)):
        try:
            ckpt = load_checkpoint(path)
            missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else keys
            if missing:
                raise CheckpointError(f"{path} is not a training checkpoint: no {missing}")
        except CheckpointError as e:
            failed.append((path, e))
            continue
        for bad, e in failed:
            os.replace(bad, bad + ".corrupt")
            warn(f"warning: {e}; kept it as {bad}.corrupt and resumed from {path}")
        return path, ckpt
    if failed:
        why = "; ".join(str(e) for _, e in failed)
        raise CheckpointError(f"no checkpoint in {out_dir} loads: {why}")
    return None, None


def load_for_resume(out_dir, keys, warn, ddp=False, rank=0):
    """load_newest on rank 0, which also renames what does not load; under DDP the other ranks
    then load the checkpoint that rank 0 chose (or raise its error), so all resume from one."""
    path = ckpt = error = None
    if rank == 0:
        try:
            path, ckpt = load_newest(out_dir, keys, warn)
        except CheckpointError as e:
            error = str(e)
    if ddp:
        choice = [path, error]
        dist.broadcast_object_list(choice, src=0)
        path, error = choice
    if error is not None:
        raise CheckpointError(error)
    if rank != 0 and path is not None:
        ckpt = load_checkpoint(path)
    return path, ckpt


def rng_state(device):
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state, rank, device):
    """state: {"torch": [per-rank CPU RNG state], "cuda": [per-rank CUDA RNG state or None]}."""
    torch.set_rng_state(state["torch"][rank])
    if device.type == "cuda" and state["cuda"][rank] is not None:
        torch.cuda.set_rng_state(state["cuda"][rank], device)
