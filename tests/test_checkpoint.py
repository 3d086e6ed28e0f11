"""Checkpoint writes that fail (disk full) and checkpoints that do not load (truncated, corrupt):
the file is named, nothing half-written stays behind, and earlier checkpoints are kept."""

import builtins
import errno
import functools
import os
import shutil
import subprocess
import sys

import pytest
import torch

import checkpoint
import train
from conftest import read_log
from errors import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _FullDisk:
    """A file opened for writing whose writes fail with ENOSPC once `room` bytes are written, as
    on a full disk."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_checkpoint_write_that_fails_leaves_no_temp_file_and_says_why(
    tiny_args, tmp_path, monkeypatch
):
    """The second checkpoint's write fails with ENOSPC: its temp file is removed, the error names
    the file, the free space and the size needed, the first checkpoint is intact, and the command
    line exits non-zero with that one line."""
    opened = []

    def open_full_after_one(path, mode="r", *a, **k):
        f = builtins.open(path, mode, *a, **k)
        opened.append(path)
        return f if len(opened) == 1 else _FullDisk(f, room=1000)

    monkeypatch.setattr(checkpoint, "open", open_full_after_one, raising=False)
    out = tmp_path / "out"
    args = tiny_args + [f"--out_dir={out}", "--max_steps=6", "--ckpt_interval=2", "--keep_last=0"]
    with pytest.raises(SystemExit) as exit_:
        run_main(functools.partial(train.main, args), train.USER_ERRORS)
    msg = str(exit_.value.code)
    assert "\n" not in msg and msg.startswith("checkpoint error: ")
    assert f"{out / 'ckpt_0000004.pt'}: No space left on device" in msg
    assert "free in" in msg and "needs about 0.6 MB" in msg
    assert f"{out / 'ckpt_0000002.pt'}, is intact" in msg
    assert sorted(os.listdir(out)) == ["ckpt_0000002.pt", "log.jsonl"]  # no .tmp left
    assert checkpoint.load_checkpoint(out / "ckpt_0000002.pt")["step"] == 2
    assert max(read_log(out)[0]) == 3


@pytest.fixture
def small_disk(tmp_path):
    """A 800 KB tmpfs (room for one tiny-run checkpoint of 554 KB, not two); needs root."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=800k", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_disk_full_on_a_real_filesystem(tiny_args, small_disk):
    """python train.py with out_dir on a small tmpfs: the second checkpoint does not fit. One
    line on stderr, no traceback, exit status 1, no temp file filling the disk."""
    out = small_disk / "out"
    args = tiny_args + [f"--out_dir={out}", "--max_steps=6", "--ckpt_interval=2", "--keep_last=1"]
    res = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert f"{out / 'ckpt_0000004.pt'}: No space left on device" in res.stderr
    assert sorted(os.listdir(out)) == ["ckpt_0000002.pt", "log.jsonl"]
    assert torch.load(out / "ckpt_0000002.pt", weights_only=True)["step"] == 2
