"""Checkpoint files: out_dir/ckpt_{step:07d}.pt, written atomically, loaded with weights_only=True.

A write goes to a temporary file that is fsynced and then renamed, so a crash leaves either the
old files or the complete new one; the newest `keep_last` are kept.
"""

import glob
import os

import torch


def list_checkpoints(out_dir):
    """Checkpoint paths in out_dir, oldest first (names are zero-padded, so sorting is by step)."""
    return sorted(glob.glob(os.path.join(out_dir, "ckpt_[0-9]*.pt")))


def save_checkpoint(obj, out_dir, step, keep_last):
    """Write out_dir/ckpt_{step:07d}.pt atomically, then delete all but the newest keep_last."""
    path = os.path.join(out_dir, f"ckpt_{step:07d}.pt")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
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


def load_checkpoint(path):
    return torch.load(path, map_location="cpu", weights_only=True)
