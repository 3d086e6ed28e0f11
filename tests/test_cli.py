"""The command lines' one language (gpt2_fused/training/cli.py): every command takes --name=value,
--name value and either spelling of a name; an unknown flag is one line naming the closest known
one; every usage error is one line with exit status 2 (errors.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import data.fineweb
import data.hellaswag
import data.tinystories
import eval_hellaswag
import sample
from gpt2_fused.training.cli import ArgumentParser
from gpt2_fused.training.config import ConfigError, load_config
from gpt2_fused.training.errors import USAGE_EXIT, UsageError, run_main

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO / "tests" / "fixtures" / "stories_sample.txt"

# each form of the same setting: --name=value, --name value, and the other spelling of the name
FORMS = {
    "train.py": [["--max_steps=7"], ["--max_steps", "7"], ["--max-steps=7"], ["--max-steps", "7"]],
    "sample.py": [
        ["--max-new-tokens=7"],
        ["--max-new-tokens", "7"],
        ["--max_new_tokens=7"],
        ["--max_new_tokens", "7"],
    ],
}


@pytest.mark.parametrize("argv", FORMS["train.py"])
def test_train_config_forms(argv):
    assert load_config(argv).max_steps == 7


def test_train_config_values_switches_and_files(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("max_steps = 3\n")
    # a switch alone keeps the config file after it; True/False/None after a switch is its value
    cfg = load_config(["--resume", str(cfg_file), "--compile", "False", "--beta1", "-1"])
    assert (cfg.resume, cfg.max_steps, cfg.compile, cfg.beta1) == (True, 3, False, -1.0)
    cfg = load_config(["--resume", "False", "--z-loss", "1e-4", "--out_dir", "-x", "--device=cpu"])
    assert (cfg.resume, cfg.z_loss, cfg.out_dir, cfg.device) == (False, 1e-4, "-x", "cpu")
    assert load_config(["--model", "gpt2", "--n-layer", "2"]).model.n_layer == 2
    with pytest.raises(ConfigError, match="'n_layer' needs a value"):
        load_config(["--n_layer", "--resume"])  # a value beginning with -- needs the = form


@pytest.mark.parametrize(
    "typo, near",
    [
        ("--max-step", "--max_steps"),
        ("--max_step", "--max_steps"),
        ("--learning-rat", "--learning_rate"),
    ],
)
def test_train_unknown_flag_names_the_closest(typo, near):
    with pytest.raises(ConfigError) as e:
        load_config([typo, "3"])
    assert str(e.value) == f"{typo}: unknown flag; did you mean {near}? (--help lists them)"


@pytest.mark.parametrize("argv", FORMS["sample.py"])
def test_sample_forms(argv):
    assert sample.parse_args(["--ckpt", "out", *argv]).max_new_tokens == 7


def test_argparse_forms_negative_numbers_and_switches():
    p = ArgumentParser()
    p.add_argument("--beta", type=float)
    p.add_argument("--files", nargs="+")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(["--beta", "-1e-4", "--files", "a", "b", "--no_progress"])
    assert (args.beta, args.files, args.no_progress) == (-1e-4, ["a", "b"], True)
    with pytest.raises(UsageError, match=r"^--bet: unknown flag; did you mean --beta\?"):
        p.parse_args(["--bet", "1"])  # no abbreviations: a typo is not taken for a prefix
    with pytest.raises(UsageError, match="^unexpected argument 'stray'$"):
        p.parse_args(["stray"])
    with pytest.raises(UsageError, match="^argument --beta: invalid float value: 'x'$"):
        p.parse_args(["--beta", "x"])


def test_eval_hellaswag_forms():
    for argv in (["--hf_dir", "d", "--limit", "3"], ["--hf-dir=d", "--limit=3"]):
        args = eval_hellaswag.parse_args(argv)
        assert (args.hf_dir, args.limit) == ("d", 3)
    with pytest.raises(UsageError, match=r"^--limt: unknown flag; did you mean --limit\?"):
        eval_hellaswag.parse_args(["--hf-dir", "d", "--limt", "3"])


def test_hellaswag_download_forms(monkeypatch):
    got = []
    monkeypatch.setattr(data.hellaswag, "download", got.append)
    for argv in (["--out_dir", "x"], ["--out-dir=x"], ["--out_dir=x"], ["--out-dir", "x"]):
        data.hellaswag.main(["download", *argv])
    assert got == ["x"] * 4
    with pytest.raises(UsageError, match=r"^--outdir: unknown flag; did you mean --out-dir\?"):
        data.hellaswag.main(["download", "--outdir", "x"])


@pytest.mark.parametrize("command", [data.fineweb, data.tinystories])
def test_prepare_scripts_forms(command, tmp_path):
    for i, forms in enumerate(
        (["--out_dir", "{d}", "--val_from", "{s}"], ["--out-dir={d}", "--val-from={s}"])
    ):
        out = tmp_path / str(i)
        argv = [a.format(d=out, s=STORIES) for a in forms]
        command.main(["--from_text", str(STORIES), *argv, "--workers", "1", "--no_progress"])
        assert len(list(out.glob("*_train_*.bin"))) == 1
    with pytest.raises(UsageError, match=r"^--from-txt: unknown flag; did you mean --from-text\?"):
        command.main(["--from-txt", str(STORIES)])


def test_run_main_prints_a_usage_error_as_one_line_with_status_2(capsys):
    def bad():
        raise UsageError("--x: unknown flag")

    with pytest.raises(SystemExit) as e:
        run_main(bad, {ValueError: "error"})  # the most specific label wins
    assert e.value.code == USAGE_EXIT == 2
    assert capsys.readouterr().err == "usage error: --x: unknown flag\n"


@pytest.mark.parametrize(
    "argv, line",
    [
        (["train.py", "--max-step", "5"], "config error: --max-step: unknown flag; did you mean "),
        (["sample.py", "--ckpt", "x", "--max-tokens", "5"], "usage error: --max-tokens: unknown "),
        (["sample.py", "--ckpt", "x", "--top-p", "2"], "usage error: --top-p must be in (0, 1]"),
        (["-m", "data.hellaswag", "download", "--out", "x"], "usage error: --out: unknown flag"),
    ],
)
def test_usage_errors_are_one_line_and_status_2(argv, line):
    res = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        env=dict(os.environ, GPT2_DEBUG="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(line) and res.stderr.count("\n") == 1, res.stderr


def test_help_still_prints_everything(capsys):
    with pytest.raises(SystemExit) as e:
        sample.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "tokens generated per sample (default: 200)" in out


def test_train_help_shows_the_config_files_values(capsys):
    import train

    train.main([str(REPO / "configs" / "tinystories.py"), "--max_steps=7", "--help"])
    out = capsys.readouterr().out
    assert "Settings (--name=value with " in out and "--max_steps=7 " in out
    assert "--dataset='data/cache/tinystories' " in out and "  --n_layer=8 " in out
