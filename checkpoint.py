"""Checkpoint files: out_dir/ckpt_{step:07d}.pt, written atomically, loaded with weights_only=True.

A write goes to a temporary file that is fsynced and then renamed, so a crash leaves either the
old files or the complete new one; the newest `keep_last` are kept. A write that fails (a full
disk) removes its temporary file and raises CheckpointError, which names the file, the free space
and the size needed.
"""

import glob
import os
import shutil

import torch


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message names the file."""


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
    cause = e.__context__ if isinstance(e.__context__, OSError) else e
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


def load_checkpoint(path):
    return torch.load(path, map_location="cpu", weights_only=True)
