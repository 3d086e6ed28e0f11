"""Checkpoint writes that fail (disk full) and checkpoints that do not load (truncated, corrupt):
the file is named, nothing half-written stays behind, and earlier checkpoints are kept."""

import builtins
import errno
import functools
import os
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import train
from conftest import LOSS_PNG, read_log
from gpt2_fused.training import checkpoint
from gpt2_fused.training.errors import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _FullDisk:
    """A file opened for writing whose writes fail with ENOSPC once `room` bytes are written, as
    on a full disk."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        n = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
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


def test_a_failed_fsync_is_reported_the_same_way(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save_checkpoint({"w": torch.ones(250_000)}, tmp_path, 1, keep_last=1)
    msg = str(err.value)
    assert msg.startswith(f"cannot write {tmp_path / 'ckpt_0000001.pt'}: No space left")
    assert msg.endswith(f"needs about 1.0 MB); no checkpoint has been saved in {tmp_path}")
    assert os.listdir(tmp_path) == []


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


def _truncate(path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return raw[: len(raw) // 2]


def _flip_tensor_byte(path):
    """Invert one byte in the middle of the largest tensor's bytes, as a disk or a copy might:
    the zip stays well-formed and torch.load still loads it."""
    with zipfile.ZipFile(path) as z:
        rec = max(z.infolist(), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    header = rec.header_offset  # a local file header: 30 bytes, then the name and extra field
    name_len, extra_len = struct.unpack("<HH", raw[header + 26 : header + 30])
    raw[header + 30 + name_len + extra_len + rec.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    return bytes(raw)


@pytest.mark.parametrize(
    "damage, says", [(_truncate, "load (RuntimeError: "), (_flip_tensor_byte, "fails its CRC-32")]
)
def test_resume_falls_back_past_a_corrupt_newest_checkpoint(
    tiny_args, tmp_path, capsys, damage, says
):
    """ckpt 4 truncated to half, or one byte of its weights flipped: --resume warns naming it,
    keeps it as .corrupt, resumes from ckpt 2 and recomputes steps 2-3 bit-identically; a stale
    .tmp from a kill is removed."""
    out = tmp_path / "out"
    args = tiny_args + [f"--out_dir={out}", "--eval_interval=2", "--ckpt_interval=2"]
    args += ["--keep_last=2"]
    train.main(args + ["--max_steps=4"])
    before, _ = read_log(out)
    newest = out / "ckpt_0000004.pt"
    damaged = damage(newest)
    (out / "ckpt_0000006.pt.tmp").write_bytes(b"cut short by a kill")
    capsys.readouterr()
    train.main(args + ["--max_steps=6", "--resume"])
    text = capsys.readouterr().out
    warnings = [line for line in text.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{newest} does not load (" in warnings[0], warnings
    assert says in warnings[0], warnings
    assert f"kept it as {newest}.corrupt and resumed from {out / 'ckpt_0000002.pt'}" in text
    assert f"resumed from {out / 'ckpt_0000002.pt'} at step 2" in text
    assert f"removed {out / 'ckpt_0000006.pt.tmp'}" in text
    assert (out / "ckpt_0000004.pt.corrupt").read_bytes() == damaged  # kept, not deleted
    after, _ = read_log(out)
    assert sorted(after) == list(range(6)) and all(after[s] == before[s] for s in range(4))
    names = sorted(os.listdir(out))
    kept = ["ckpt_0000004.pt", "ckpt_0000004.pt.corrupt", "ckpt_0000006.pt", "log.jsonl"]
    assert names == [*kept, *LOSS_PNG]


def test_resume_refuses_when_no_checkpoint_loads(tiny_args, tmp_path):
    out = tmp_path / "out"
    args = tiny_args + [f"--out_dir={out}", "--eval_interval=0", "--ckpt_interval=1"]
    args += ["--max_steps=2", "--keep_last=2"]
    train.main(args)
    for path in out.glob("ckpt_*.pt"):
        _truncate(path)
    with pytest.raises(checkpoint.CheckpointError, match="ckpt_0000002.pt does not load.*0001"):
        train.main(args[:-2] + ["--max_steps=3", "--resume"])
    assert sorted(p.name for p in out.glob("ckpt_*")) == ["ckpt_0000001.pt", "ckpt_0000002.pt"]


@pytest.mark.parametrize(
    "damage", ["truncated", "empty", "not a zip", "malicious pickle", "a weight's byte flipped"]
)
def test_damaged_checkpoints_are_named(tmp_path, damage):
    path = tmp_path / "ckpt_0000001.pt"
    torch.save({"model": {"w": torch.ones(1000)}, "step": 1}, path)
    if damage == "truncated":
        _truncate(path)
    elif damage == "a weight's byte flipped":
        _flip_tensor_byte(path)
        w = torch.load(path, weights_only=True)["model"]["w"]  # torch.load alone sees nothing
        assert (w != 1).sum() == 1
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "not a zip":
        path.write_bytes(b"step = 1\n" * 100)
    else:
        torch.save({"x": _Evil()}, path)
    with pytest.raises(checkpoint.CheckpointError, match=f"{path} does not load"):
        checkpoint.load_checkpoint(path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def _sample_py_error(ckpt):
    """stderr of `python sample.py --ckpt CKPT` on CPU, which must fail in one line, exit 1."""
    res = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", str(ckpt), "--device", "cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    return res.stderr


def test_sample_names_a_damaged_checkpoint_in_one_line(tmp_path):
    path = tmp_path / "ckpt_0000001.pt"
    torch.save({"model": {"w": torch.ones(1000)}, "step": 1}, path)
    _truncate(path)
    err = _sample_py_error(tmp_path)
    assert err.startswith(f"checkpoint error: {path} does not load (RuntimeError: ")


@pytest.mark.parametrize(
    "content, says",
    [
        ({"weights": torch.ones(3)}, "is not a checkpoint: needs 'model' and 'model_config'"),
        ({"model": {}, "model_config": {"n_embd": 32, "rope": True}}, "unknown model_config keys"),
        ({"model": {}, "model_config": {"n_embd": 30, "n_head": 4}}, "not divisible"),
        ({"model": {"w": torch.ones(1)}, "model_config": {"n_layer": 1}}, "missing keys"),
    ],
)
def test_sample_names_a_file_that_loads_but_is_no_checkpoint(tmp_path, content, says):
    """A file torch loads that is not a checkpoint of this model (another program's, a config
    this code does not know, weights that do not fit): one line naming it, no traceback."""
    path = tmp_path / "ckpt_0000001.pt"
    torch.save(content, path)
    err = _sample_py_error(path)
    assert err.startswith(f"checkpoint error: {path}") and says in err, err


def test_a_log_write_that_fails_stops_the_run_in_one_line(tiny_args, tmp_path, monkeypatch):
    """log.jsonl on a full disk (after a checkpoint has been written): the run stops with a
    LogError naming the file, the step and the newest checkpoint (one line through errors.py),
    not a raw OSError from the write or from closing the file."""
    from gpt2_fused.training import runlog

    out = tmp_path / "out"
    real_open = open

    def full_log(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return _FullDisk(f, room=700) if str(path).endswith("log.jsonl") and "a" in mode else f

    monkeypatch.setattr(runlog, "open", full_log, raising=False)  # RunLog opens log.jsonl
    args = tiny_args + [f"--out_dir={out}", "--max_steps=8", "--ckpt_interval=2"]
    with pytest.raises(runlog.LogError) as err:
        train.main(args)
    msg = str(err.value)
    assert f"cannot write {out / 'log.jsonl'} (No space left on device): stopped at step" in msg
    assert "without saving; the newest checkpoint, " in msg and "ckpt_000000" in msg
    assert "\n" not in msg


def test_resume_drops_a_log_line_cut_short_and_names_a_damaged_one(tiny_args, tmp_path):
    """A full disk can stop a run mid-write, leaving log.jsonl's last line without its end:
    --resume drops that line and goes on. A damaged line elsewhere stops the run in one line
    naming it, rather than a traceback or a silent drop."""
    out = tmp_path / "out"
    args = tiny_args + [f"--out_dir={out}", "--eval_interval=0", "--ckpt_interval=2"]
    train.main(args + ["--max_steps=3"])  # saves at 2 and 3
    straight, _ = read_log(out)
    log = out / "log.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"step": 3, "loss": 10.9, "tok_per_s"')  # no newline: cut short
    train.main(args + ["--max_steps=4", "--resume"])
    losses, _ = read_log(out)
    assert sorted(losses) == [0, 1, 2, 3] and all(losses[s] == straight[s] for s in range(3))
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], lines[1][:-9], *lines[2:]]) + "\n")
    with pytest.raises(SystemExit) as stop:
        run_main(
            functools.partial(train.main, args + ["--max_steps=5", "--resume"]), train.USER_ERRORS
        )
    msg = stop.value.code
    assert (
        "\n" not in msg
        and msg.startswith(f"log error: {log}:2: not a JSON line (")
        and "move the file" in msg
    )
