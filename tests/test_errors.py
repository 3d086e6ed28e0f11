"""Errors a user can fix are one line naming the file and the problem, exit status 1, no
traceback (errors.py; GPT2_DEBUG=1 shows it): data, config files, for train.py and the prepare
scripts."""

import functools
import lzma
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import data.fineweb
import train
from data.prepare import CLI_ERRORS
from data.shards import HEADER_BYTES, read_shard, write_shard
from gpt2_fused.training.errors import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_line_error(main, user_errors):
    """The message main() exits with through run_main (the command lines' path), checked to be
    one line."""
    with pytest.raises(SystemExit) as exit_:
        run_main(main, user_errors)
    msg = exit_.value.code
    assert isinstance(msg, str) and "\n" not in msg
    return msg


def _patch(path, offset, value):
    """Overwrite the bytes of `value` (a numpy scalar) at `offset` of the file."""
    raw = bytearray(path.read_bytes())
    raw[offset : offset + value.nbytes] = value.tobytes()
    path.write_bytes(bytes(raw))


def _token(position, token_id):  # a shard's token at `position` set to `token_id`
    return lambda p: _patch(p, HEADER_BYTES + 2 * position, np.uint16(token_id))


DAMAGE = {  # name -> (which shard, how it is damaged, what the message says)
    "bad magic": ("train_000001", lambda p: _patch(p, 0, np.int32(7)), "bad magic 7"),
    "truncated": (
        "train_000001",
        lambda p: p.write_bytes(p.read_bytes()[:-7]),
        "truncated or corrupt",
    ),
    "header count too large": (
        "train_000002",
        lambda p: _patch(p, 8, np.int32(10**6)),
        "header says 1000000 tokens",
    ),
    "train token id": ("train_000001", _token(500, 50257), "token id 50257 at position 500"),
    "val token id": ("val_000000", _token(600, 60000), "token id 60000 at position 600"),
    "too few train tokens": (
        "train_000002",
        lambda p: write_shard(p, [1] * 100),
        "100 tokens is too small for one step",
    ),
    "too few val tokens": (
        "val_000000",
        lambda p: write_shard(p, [1] * 100),
        "hold at most 100 tokens each, fewer than one validation step",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_data_errors_name_the_file_in_one_line(tiny_args, tiny_data, tmp_path, damage):
    shard, spoil, says = DAMAGE[damage]
    dataset = tmp_path / "data"
    shutil.copytree(tiny_data, dataset)
    (path,) = dataset.glob(f"*_{shard}.bin")
    spoil(path)
    args = tiny_args + [f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", "--max_steps=2"]
    msg = one_line_error(functools.partial(train.main, args), train.USER_ERRORS)
    assert msg.startswith("data error: ") and str(path) in msg and says in msg
    assert not (tmp_path / "out").exists()  # found before anything was written


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_a_missing_or_empty_dataset_folder(tiny_args, tmp_path, where):
    folder = tmp_path / "nothing"
    if where == "empty":
        folder.mkdir()
    args = tiny_args + [f"--dataset={folder}", f"--out_dir={tmp_path / 'out'}"]
    msg = one_line_error(functools.partial(train.main, args), train.USER_ERRORS)
    assert msg.startswith("data error: ") and str(folder) in msg
    assert ("neither 'embedded' nor a folder" if where == "missing" else "no train shards") in msg


def test_a_bad_later_shard_stops_with_what_was_saved(tiny_args, tiny_data, tmp_path):
    """Train shard 2's ids are checked when the loader reaches it (at step 3 with shard 1 cut to
    1,000 tokens): the error says so and that the step-2 checkpoint is the newest one."""
    dataset = tmp_path / "data"
    shutil.copytree(tiny_data, dataset)
    (first,) = dataset.glob("*_train_000001.bin")
    write_shard(first, read_shard(first)[:1000])
    (path,) = dataset.glob("*_train_000002.bin")
    _token(19999, 50300)(path)
    out = tmp_path / "out"
    args = tiny_args + [f"--dataset={dataset}", f"--out_dir={out}", "--max_steps=100"]
    args += ["--ckpt_interval=2", "--eval_interval=0", "--shuffle=False"]  # shard 1 first
    msg = one_line_error(functools.partial(train.main, args), train.USER_ERRORS)
    assert msg.startswith(f"data error: {path}: token id 50300 at position 19999")
    newest = out / "ckpt_0000002.pt"
    assert "stopped at step 3 without saving" in msg and newest.exists()
    assert msg.endswith(f"without saving; the newest checkpoint, {newest}, is intact")


def test_train_py_prints_one_line_and_gpt2_debug_the_traceback(tiny_args, tmp_path):
    args = [a for a in tiny_args if not a.startswith("--dataset")]
    cmd = [sys.executable, "train.py", *args, f"--dataset={tmp_path}", f"--out_dir={tmp_path}/o"]
    for debug in ("0", "1"):
        env = dict(os.environ, GPT2_DEBUG=debug)
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 1
        if debug == "0":
            assert res.stderr == f"data error: no train shards in {tmp_path} " + (
                "(expected files matching *_train_*.bin): make them with python -m data.fineweb "
                f"--from-text FILES --out-dir {tmp_path}\n"
            )
        else:
            assert "Traceback" in res.stderr and "DataError: no train shards" in res.stderr


@pytest.mark.parametrize("kind", ["binary", "truncated .xz"])
def test_prepare_names_an_unreadable_input_file(tmp_path, kind):
    path = tmp_path / ("shard.bin" if kind == "binary" else "text.txt.xz")
    if kind == "binary":
        path.write_bytes(b"a line of text\n" + bytes(range(256)) * 4)
    else:
        path.write_bytes(lzma.compress(b"some text\n" * 10000)[:100])
    argv = ["--from-text", str(path), "--out-dir", str(tmp_path / "out"), "--no-progress"]
    msg = one_line_error(functools.partial(data.fineweb.main, argv), CLI_ERRORS)
    if kind == "binary":
        assert (
            msg == f"data error: {path}: not UTF-8 text (invalid start byte 0x80); a binary file?"
        )
    else:
        assert msg.startswith(f"data error: {path}: cannot be decompressed (")


def usage_error(main, user_errors, capsys):
    """The line main() prints through run_main for a usage error (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        run_main(main, user_errors)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("where", ["a folder, not a file", "not found"])
def test_prepare_names_a_bad_input_file(tmp_path, capsys, where):
    path = tmp_path if where.startswith("a folder") else tmp_path / "nothere.txt"
    argv = ["--from-text", str(path), "--out-dir", str(tmp_path / "out"), "--no-progress"]
    msg = usage_error(functools.partial(data.fineweb.main, argv), CLI_ERRORS, capsys)
    assert msg == f"usage error: input file {where}: {path}"


def test_ctrl_c_outside_a_training_loop_is_one_line_and_status_130(capsys, monkeypatch):
    """KeyboardInterrupt (start-up, sampling, preparing data): "interrupted" and 128 + SIGINT, as
    a shell reports it, with the traceback only under GPT2_DEBUG=1."""

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stop:
        run_main(interrupted, CLI_ERRORS)
    assert stop.value.code == 130 and capsys.readouterr().err == "interrupted\n"
    monkeypatch.setenv("GPT2_DEBUG", "1")
    with pytest.raises(KeyboardInterrupt):
        run_main(interrupted, CLI_ERRORS)


def test_prepare_command_line_error_is_one_line(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)) * 4)
    res = subprocess.run(
        [sys.executable, "-m", "data.fineweb", "--from-text", str(path), "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        f"data error: {path}: not UTF-8 text (invalid start byte 0x80); a binary file?"
    ]


@pytest.mark.parametrize("command", ["fineweb", "tinystories"])
@pytest.mark.parametrize("why", ["offline", "unreachable"])
def test_prepare_from_the_hub_without_network_stops_at_once(tmp_path, monkeypatch, command, why):
    """No network (or HF_HUB_OFFLINE): one line, exit 1, before `datasets`' retries and without
    touching out_dir; the hub is never really asked here."""
    import datasets
    import huggingface_hub

    import data.tinystories

    def unreachable(self, repo, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", why == "offline")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("load_dataset"))
    main = {"fineweb": data.fineweb.main, "tinystories": data.tinystories.main}[command]
    argv = ["--out-dir", str(tmp_path / "out"), "--no-progress"]
    msg = one_line_error(functools.partial(main, argv), CLI_ERRORS)
    repo = "HuggingFaceFW/fineweb" if command == "fineweb" else "roneneldan/TinyStories"
    local = f"or prepare local text: python -m data.{command} --from-text FILES"
    if why == "offline":
        assert msg == (
            f"network error: {repo} is streamed from the Hugging Face hub, but HF_HUB_OFFLINE is "
            f"set: unset it, {local}"
        )
    else:
        assert msg.startswith(f"network error: cannot reach {repo} on the Hugging Face hub (")
        assert "OSError: [Errno -2] Name or service not known" in msg
        assert msg.endswith(f"needs network (behind a proxy: HTTPS_PROXY=http://HOST:PORT; a "
                            f"mirror: HF_ENDPOINT=URL), {local}")  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config, command",
    [
        ("tinystories.py", "python -m data.tinystories"),
        ("gpt2_124m_fineweb.py", "python -m data.fineweb"),
        ("gpt2_1558m_fineweb_edu.py", "python -m data.fineweb --edu --version 100BT"),
    ],
)
def test_a_recipe_before_its_data_names_the_prepare_command(tmp_path, monkeypatch, config, command):
    monkeypatch.chdir(tmp_path)  # where the recipe's data/cache/NAME is the cache, still empty
    monkeypatch.setattr("data.prepare.CACHE_DIR", tmp_path / "data" / "cache")
    argv = [os.path.join(REPO, "configs", config), "--out_dir=out", "--device=cpu"]
    msg = one_line_error(functools.partial(train.main, argv), train.USER_ERRORS)
    assert msg.startswith("data error: dataset 'data/cache/")
    assert msg.endswith(f"a folder of shards: not prepared yet? make them with {command}")


def test_wandb_that_cannot_start_is_one_line_and_leaves_no_log(tiny_args, tmp_path, monkeypatch):
    """--wandb=True without a login stops the run in one line (exit 1) before out_dir/log.jsonl
    is made, as a nanoGPT user expects a run to stop rather than train unlogged."""
    wandb = pytest.importorskip("wandb")

    def no_login(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_login)
    out = tmp_path / "out"
    argv = tiny_args + [f"--out_dir={out}", "--max_steps=2", "--wandb=True"]
    msg = one_line_error(functools.partial(train.main, argv), train.USER_ERRORS)
    assert msg == (
        "log error: wandb=True, but W&B did not start (No API key configured. Use `wandb login` to "
        "log in.): run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log "
        "locally, or drop --wandb"
    )
    assert not out.exists()


def test_val_tokens_below_one_step_is_a_config_error(tiny_args, tmp_path, capsys):
    # less than a micro-batch (4 * 32) takes fewer rows; less than one sequence cannot run
    argv = tiny_args + [f"--out_dir={tmp_path / 'out'}", "--val_tokens=20"]
    with pytest.raises(SystemExit) as exit_:
        run_main(functools.partial(train.main, argv), train.USER_ERRORS)
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        "config error: val_tokens=20 is less than one validation step of "
        "batch_size*block_size*world_size = 1*32*1 = 32 tokens: pass --val_tokens=32 or more\n"
    )
