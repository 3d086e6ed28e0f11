"""sample.py: the command line end to end on a tiny random checkpoint (CPU)."""

import shutil
from dataclasses import asdict

import pytest
import torch

import sample
from data.tokenizer import EOT, get_tokenizer
from gpt2_fused.training import model_io
from gpt2_fused.training.errors import run_main
from gpt2_fused.training.generate import generate
from model import GPT, GPTConfig

V, VP = 50257, 50304


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=V, padded_vocab_size=VP
    )
    model = GPT(cfg)
    with torch.no_grad():  # the tied classifier would pick a padded id every time if it could
        model.transformer.wte.weight[V:] = 1e4
    d = tmp_path_factory.mktemp("out")
    ckpt = {"model": model.state_dict(), "model_config": asdict(cfg), "step": 7, "val_loss": None}
    torch.save(ckpt, d / "ckpt_0000007.pt")
    return d


def run(capsys, *argv):
    out = sample.main([*argv, "--device", "cpu", "--num-samples", "3", "--max-new-tokens", "40"])
    return out, capsys.readouterr().out


def test_same_seed_same_text_and_prompt_kept(capsys, ckpt_dir):
    ids_a, text_a = run(capsys, "--ckpt", str(ckpt_dir), "--prompt", "Hello world", "--seed", "1")
    ids_b, text_b = run(capsys, "--ckpt", str(ckpt_dir), "--prompt", "Hello world", "--seed", "1")
    ids_c, text_c = run(capsys, "--ckpt", str(ckpt_dir), "--prompt", "Hello world", "--seed", "2")
    assert text_a == text_b and torch.equal(ids_a, ids_b)
    assert text_a != text_c
    prompt = get_tokenizer().encode("Hello world")
    assert ids_a.shape == (3, len(prompt) + 40)  # 40 new tokens go past block_size=32: cropped
    assert ids_a[:, : len(prompt)].tolist() == [prompt] * 3
    assert int(ids_a.max()) < V  # the poisoned padded rows are never sampled
    samples = text_a.split("-" * 40 + "\n")[:-1]
    assert len(samples) == 3 and all(s.startswith("Hello world") for s in samples)
    assert samples[0] == get_tokenizer().decode(ids_a[0].tolist()) + "\n"


def test_prompt_file_and_hf_dir_agree_with_ckpt(capsys, ckpt_dir, tmp_path):
    (tmp_path / "prompt.txt").write_text("The meaning of life is", encoding="utf-8")
    model, _ = model_io.from_checkpoint(ckpt_dir)
    model_io.save_hf(model, tmp_path / "hf")
    common = ["--seed", "3", "--top-p", "0.9", "--temperature", "1.0"]
    ids_a, _ = run(capsys, "--ckpt", str(ckpt_dir), "--prompt", "The meaning of life is", *common)
    ids_b, _ = run(
        capsys, "--ckpt", str(ckpt_dir), "--prompt-file", str(tmp_path / "prompt.txt"), *common
    )
    ids_c, _ = run(
        capsys,
        "--hf-dir",
        str(tmp_path / "hf"),
        "--prompt-file",
        str(tmp_path / "prompt.txt"),
        *common,
    )
    assert torch.equal(ids_a, ids_b) and torch.equal(ids_a, ids_c)


def test_greedy_equals_model_generate_and_default_prompt_is_eot(capsys, ckpt_dir):
    ids, text = run(capsys, "--ckpt", str(ckpt_dir), "--temperature", "0")
    model, _ = model_io.from_checkpoint(ckpt_dir)
    expected = generate(model.eval(), torch.full((3, 1), EOT), 40, temperature=0)
    assert torch.equal(ids, expected)
    assert not text.startswith("<|endoftext|>")  # our own start token is not printed


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no --ckpt / --hf-dir
        ["--ckpt", "x", "--hf-dir", "y"],
        ["--ckpt", "x", "--prompt", "a", "--prompt-file", "b"],
        ["--ckpt", "x", "--prompt-file", "/nonexistent/prompt.txt"],
        ["--ckpt", "x", "--top-p", "1.5"],
        ["--ckpt", "x", "--temperature", "-1"],
        ["--ckpt", "x", "--dtype", "int8"],
        ["--ckpt", "x", "--device", "cpu", "--decode", "graph"],  # before any model loads
    ],
)
def test_bad_arguments_are_one_line_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(lambda: sample.main(argv), model_io.USER_ERRORS)
    assert e.value.code == 2  # a usage error (gpt2_fused/training/errors.py)
    err = capsys.readouterr().err
    assert err.startswith("usage error: ") and err.count("\n") == 1, err


def test_says_what_it_loaded_and_a_prompt_past_the_vocabulary_is_a_usage_error(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=100)
    ckpt = {"model": GPT(cfg).state_dict(), "model_config": asdict(cfg), "step": 3}
    torch.save(ckpt, tmp_path / "ckpt_0000003.pt")
    argv = ["--ckpt", str(tmp_path), "--device", "cpu", "--max-new-tokens", "2"]
    sample.main([*argv, "--prompt", "!"])  # token id 0
    assert capsys.readouterr().err.startswith(f"loaded {tmp_path / 'ckpt_0000003.pt'} (step 3)\n")
    for prompt, what in (([], "<|endoftext|> (the default prompt) 50256"), (["--prompt", "Hi"],
                         "the prompt's token id 17250")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            run_main(lambda p=prompt: sample.main([*argv, *p]), model_io.USER_ERRORS)
        err = capsys.readouterr().err.splitlines()[-1]
        assert e.value.code == 2 and err == (
            f"usage error: {what} is past the model's vocab_size=100: give a --prompt whose "
            "GPT-2 token ids are all below 100"
        )


def test_a_prompt_file_that_is_not_text_is_named_before_any_model_loads(tmp_path, capsys):
    path = tmp_path / "prompt.bin"
    path.write_bytes(b"Once upon" + bytes([0xF1, 0x80, 0xFF]))
    argv = ["--ckpt", str(tmp_path / "no_such_ckpt"), "--prompt-file", str(path)]
    with pytest.raises(SystemExit) as e:
        run_main(lambda: sample.main(argv), model_io.USER_ERRORS)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage error: --prompt-file {path} is not UTF-8 text (") and (
        err.count("\n") == 1
    )


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ckpt_"):
        sample.main(["--ckpt", str(tmp_path), "--device", "cpu"])


@pytest.mark.parametrize("where", ["missing file", "missing dir"])
def test_a_missing_ckpt_path_is_one_line_naming_it(tmp_path, where):
    path = tmp_path / ("ckpt_0000001.pt" if where == "missing file" else "nothing")
    with pytest.raises(SystemExit) as e:
        argv = ["--ckpt", str(path), "--device", "cpu"]
        run_main(lambda: sample.main(argv), model_io.USER_ERRORS)
    assert e.value.code == f"error: checkpoint {path} does not exist"


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(capsys, ckpt_dir, tmp_path):
    """As --resume does: the newest that loads, the one skipped named on stderr (and, unlike
    --resume, left where it is: sampling does not change a run's directory)."""
    shutil.copy(ckpt_dir / "ckpt_0000007.pt", tmp_path / "ckpt_0000007.pt")
    newest = tmp_path / "ckpt_0000009.pt"
    raw = (ckpt_dir / "ckpt_0000007.pt").read_bytes()
    newest.write_bytes(raw[: len(raw) // 2])  # truncated, as by a full disk or a copy cut short
    common = ["--seed", "1", "--device", "cpu", "--num-samples", "2", "--max-new-tokens", "8"]
    ids = sample.main(["--ckpt", str(tmp_path), *common])
    err = capsys.readouterr().err
    assert torch.equal(ids, sample.main(["--ckpt", str(ckpt_dir), *common]))
    assert err.startswith(f"warning: {newest} does not load (")
    assert f"truncated or corrupt; skipped it and loaded {tmp_path / 'ckpt_0000007.pt'}\n" in err
    assert newest.exists()


def test_no_checkpoint_that_loads_names_them_all(tmp_path):
    for step in (1, 2):
        (tmp_path / f"ckpt_000000{step}.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        run_main(
            lambda: sample.main(["--ckpt", str(tmp_path), "--device", "cpu"]), model_io.USER_ERRORS
        )
    msg = e.value.code
    assert msg.startswith(f"checkpoint error: no checkpoint in {tmp_path} loads: ")
    assert all(f"ckpt_000000{step}.pt does not load" in msg for step in (1, 2))


def test_one_sample_is_streamed_and_the_speed_goes_to_stderr(capsys, ckpt_dir, monkeypatch):
    writes = []
    real_write = sample.Stream.write
    monkeypatch.setattr(
        sample.Stream, "write", lambda self, ids: writes.append(ids) or real_write(self, ids)
    )
    out = sample.main(
        ["--ckpt", str(ckpt_dir), "--device", "cpu", "--num-samples", "1", "--max-new-tokens", "40",
         "--prompt", "Hello world"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert captured.out == get_tokenizer().decode(out[0].tolist()) + "\n" + "-" * 40 + "\n"
    assert sum(writes, []) == out[0].tolist() and len(writes) == 41  # the prompt, then each token
    assert "1 x 40 tokens in" in captured.err and "tok/s" in captured.err


def test_stream_holds_a_split_character_back_until_its_last_byte(capsys):
    enc = get_tokenizer()
    ids = enc.encode("日本語 🙂 ok")  # 日 is two tokens (e6 97 | a5), 🙂 two more (f0 9f | 99 82)
    stream = sample.Stream(enc)
    pieces = []
    for i in ids:
        stream.push(torch.tensor([i]))
        pieces.append(capsys.readouterr().out)
    stream.close()
    pieces.append(capsys.readouterr().out)
    assert "".join(pieces) == enc.decode(ids) + "\n"
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[:3] == ["", "", "日"]  # the write lags one token behind the device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode", ["graph", "compile"])
def test_gpu_one_sample_streams_the_tokens_it_returns(capsys, ckpt_dir, decode):
    argv = ["--ckpt", str(ckpt_dir), "--device", "cuda", "--num-samples", "1", "--decode", decode]
    out = sample.main([*argv, "--max-new-tokens", "40", "--prompt", "Hello world"])
    captured = capsys.readouterr()
    assert captured.out == get_tokenizer().decode(out[0].tolist()) + "\n" + "-" * 40 + "\n"
    assert int(out.max()) < V and "tok/s" in captured.err
