"""Where a run starts (gpt2_fused/training/start.py): --init_from's weights (an HF GPT-2 directory,
a GPT-2 name in the local Hugging Face cache, one of our checkpoints or out_dirs) and --resume,
both taking the model's settings from their source, and the one-line errors around them.

The reference for a run that starts from weights is transformers' GPT-2 reading the exported
directory: the first step's logged loss is its cross-entropy on the batches that step read."""

import functools
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import train
from conftest import TINY, read_log
from data import resolve_dataset
from data.loader import DataLoader
from gpt2_fused.training import model_io, start
from gpt2_fused.training.config import ConfigError, TrainConfig, load_config
from gpt2_fused.training.errors import run_main
from gpt2_fused.training.runlog import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_FLAGS = ("--vocab_size", "--padded_vocab_size", "--n_layer", "--n_head", "--n_embd")
MODEL_FLAGS += ("--block_size", "--dropout", "--loss_impl")
# TINY without the model's settings; the torch loss (a train setting here, as it is no shape)
RUN = [a for a in TINY if not a.startswith(MODEL_FLAGS)] + ["--loss_impl=torch"]
RUN += ["--max_steps=1", "--eval_interval=0"]


class Recorder(DataLoader):
    """data.loader.DataLoader keeping the batches it gives."""

    batches = []

    def next_batch(self):
        x, y = super().next_batch()
        Recorder.batches.append((x.clone(), y.clone()))
        return x, y


@pytest.fixture(scope="module")
def exported(tiny_data, tmp_path_factory):
    """A tiny model trained 3 steps (its out_dir and checkpoint) and exported with save_hf."""
    base = tmp_path_factory.mktemp("exported")
    out = base / "trained"
    train.main([*TINY, f"--dataset={tiny_data}", "--max_steps=3", f"--out_dir={out}"])
    model, _ = model_io.from_checkpoint(out / "ckpt_0000003.pt")
    model_io.save_hf(model, base / "hf")
    return types.SimpleNamespace(out=out, ckpt=out / "ckpt_0000003.pt", hf=base / "hf")


def transformers_loss(hf_dir, batches):
    """The mean cross-entropy of transformers' GPT-2 from hf_dir over the (x, y) batches."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        losses = [F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()) for x, y in batches]
    return torch.stack(losses).mean().item()


def first_step(args, tiny_data, out_dir, capsys):
    """(step-0 loss, the batches it read, the start-up report) of a 1-step run."""
    Recorder.batches = []
    capsys.readouterr()
    train.main([*args, f"--dataset={tiny_data}", f"--out_dir={out_dir}"], train_loader=Recorder)
    losses, _ = read_log(out_dir)
    assert sorted(losses) == [0]
    return losses[0], Recorder.batches, capsys.readouterr().out


def fresh_batches(tiny_data, n, T=32):
    """The first n batches of a new loader: init_from starts the data order anew."""
    loader = DataLoader(resolve_dataset(str(tiny_data))[0], 4, T, seed=1337)
    return [loader.next_batch() for _ in range(n)]


@pytest.mark.parametrize("source", ["hf", "ckpt", "out"])
def test_init_from_starts_at_step_0_with_the_weights(exported, tiny_data, tmp_path, capsys, source):
    """No model flag: the shape comes from the source; the first loss is that of the exported
    model on the step's batches (2 micro-batches), which a new loader gives."""
    path = getattr(exported, source)
    loss, batches, out = first_step([*RUN, f"--init_from={path}"], tiny_data, tmp_path, capsys)
    assert len(batches) == 2
    for (x, y), (fx, fy) in zip(batches, fresh_batches(tiny_data, 2), strict=True):
        assert torch.equal(x, fx) and torch.equal(y, fy)
    assert loss == pytest.approx(transformers_loss(exported.hf, batches), rel=1e-5)
    assert f"init_from: {path}" in out and "step 0, a fresh optimizer" in out
    ckpt = torch.load(tmp_path / "ckpt_0000001.pt", weights_only=True)
    assert ckpt["step"] == 1 and ckpt["optimizer"]["state"][0]["step"] == 1
    assert (ckpt["model_config"]["n_embd"], ckpt["model_config"]["vocab_size"]) == (32, 512)


def test_gpt2s_vocabulary_is_padded_with_zero_rows():
    """An HF vocabulary of 100 (as GPT-2's 50257) trains as 128 rows, those past 100 zero (the
    loss masks them); the tied classifier stays tied to the loaded embedding."""
    hf_tiny = os.path.join(REPO, "tests", "fixtures", "hf_gpt2_tiny")
    cfg = load_config([f"--init_from={hf_tiny}", "--out_dir=/nonexistent"])
    begin = start.find(cfg, types.SimpleNamespace(ddp=False, rank=0), print)
    assert (begin.cfg.model.vocab_size, begin.cfg.model.padded_vocab_size) == (100, 128)
    model = train.GPT(begin.cfg.model)
    begin.load_weights(model)
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte and torch.count_nonzero(wte[100:]) == 0
    assert torch.equal(wte[:100], model_io.from_hf(hf_tiny).transformer.wte.weight[:100])


def test_init_from_a_shorter_block_cuts_the_position_embeddings(
    exported, tiny_data, tmp_path, capsys
):
    args = [*RUN, f"--init_from={exported.hf}", "--block_size=16", "--dropout=0.0"]
    loss, batches, out = first_step(args, tiny_data, tmp_path, capsys)
    assert batches[0][0].shape == (4, 16)
    assert loss == pytest.approx(transformers_loss(exported.hf, batches), rel=1e-5)
    assert "position embeddings cut to block_size=16" in out


def cached(tmp_path, exported, repo_folder):
    """A Hugging Face hub cache holding the exported model as `repo_folder`, refs/main naming
    its snapshot; an older, incomplete snapshot beside it."""
    repo = tmp_path / "hub" / repo_folder
    shutil.copytree(exported.hf, repo / "snapshots" / "abc123")
    (repo / "snapshots" / "old").mkdir()
    (repo / "snapshots" / "old" / "config.json").write_text("{}")  # weights never came
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return repo / "snapshots" / "abc123"


@pytest.mark.parametrize("folder", ["models--openai-community--gpt2", "models--gpt2"])
def test_a_gpt2_name_reads_the_hugging_face_cache(
    exported, tiny_data, tmp_path, capsys, monkeypatch, folder
):
    snapshot = cached(tmp_path, exported, folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no folder named gpt2 here
    args = [*RUN, "--init_from=gpt2"]
    loss, batches, out = first_step(args, tiny_data, tmp_path / "out", capsys)
    assert f"init_from: {snapshot}'s" in out
    assert loss == pytest.approx(transformers_loss(exported.hf, batches), rel=1e-5)


def test_hf_cache_is_found_as_huggingface_hub_finds_it(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_io.hf_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert model_io.hf_cache() == model_io.Path("/x/huggingface/hub")
    monkeypatch.setenv("HF_HOME", "/h")
    assert model_io.hf_cache() == model_io.Path("/h/hub")
    monkeypatch.setenv("HF_HUB_CACHE", "/c")
    assert model_io.hf_cache() == model_io.Path("/c")


def error_line(args, capsys):
    """(exit status, the one line printed) of train.py's command line given `args`."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_main(functools.partial(train.main, args), train.USER_ERRORS)
    code = exit_.value.code
    err = capsys.readouterr().err if code == 2 else code
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return (2 if code == 2 else 1), lines[0]


def test_an_uncached_gpt2_name_says_how_to_fill_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    args = ["--device=cpu", "--init_from=gpt2-medium", f"--out_dir={tmp_path / 'out'}"]
    code, line = error_line(args, capsys)
    assert code == 1
    assert line.startswith("checkpoint error: init_from='gpt2-medium': gpt2-medium is not in the ")
    assert f"Hugging Face cache {tmp_path / 'empty'}" in line
    assert "hf download openai-community/gpt2-medium config.json model.safetensors" in line
    assert not (tmp_path / "empty").exists()  # nothing written, nothing downloaded


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--n_embd=64"], "--n_embd=64 contradicts {src} (n_embd=32): --init_from starts from"),
        (
            ["--n_layer=3", "--vocab_size=50257"],
            "--n_layer=3, --vocab_size=50257 contradict {src} (n_layer=2, vocab_size=512)",
        ),
        (
            ["--model=gpt2", "--n_layer=2"],
            "--model='gpt2' (n_head, n_embd) contradicts {src} (n_head=2, n_embd=32)",
        ),
        (
            ["--block_size=64"],
            "(block_size=32): --init_from starts from its model, drop the flag; "
            "a smaller block_size cuts it",
        ),  # fmt: skip
        (["--softcap=30"], "--softcap=30.0 contradicts {src} (softcap=0.0)"),
    ],
)
def test_flags_that_contradict_the_weights_exit_2(exported, tiny_data, tmp_path, capsys, flags,
                                                  says):  # fmt: skip
    args = [*RUN, f"--dataset={tiny_data}", f"--init_from={exported.hf}", f"--out_dir={tmp_path}"]
    code, line = error_line([*args, *flags], capsys)
    assert code == 2 and line.startswith("config error: ")
    assert says.format(src=exported.hf) in line
    assert not tmp_path.joinpath("log.jsonl").exists()


def test_init_from_a_folder_without_weights_exits_1(tmp_path, capsys):
    code, line = error_line(["--device=cpu", f"--init_from={tmp_path}"], capsys)
    assert code == 1 and line == (
        f"checkpoint error: init_from='{tmp_path}': {tmp_path} holds neither config.json (an HF "
        "GPT-2 folder) nor ckpt_*.pt (an out_dir)"
    )


def test_unknown_init_from_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, line = error_line(["--init_from=gtp2", "--device=cpu"], capsys)
    assert code == 2
    assert line == (
        "config error: config key 'init_from': 'gtp2' is no file or directory, nor a GPT-2 name "
        "(gpt2, gpt2-medium, gpt2-large, gpt2-xl); 'scratch' trains from random weights"
    )
    code, line = error_line(["--init_from=resume"], capsys)
    assert code == 2 and "pass --resume" in line


def test_resume_takes_the_model_from_the_checkpoint_bit_identically(
    tiny_args, tiny_data, tmp_path, capsys
):
    """4 steps straight, with dropout (the RNG restored) and checkpoints at 2 and 4; a copy of
    the step-2 checkpoint resumed with no model flag (and an init_from, which the checkpoint
    wins over) logs the same losses and ends with the same weights."""
    args = [*tiny_args, "--max_steps=4", "--eval_interval=2", "--ckpt_interval=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train.main([*args, "--dropout=0.1", "--keep_last=0", f"--out_dir={straight}"])
    resumed.mkdir()
    shutil.copy(straight / "ckpt_0000002.pt", resumed)
    run = [a for a in args if not a.startswith(MODEL_FLAGS)]
    capsys.readouterr()
    train.main([*run, "--resume", "--init_from=gpt2", f"--out_dir={resumed}"])
    out = capsys.readouterr().out
    assert f"init_from='gpt2' not read: --resume continues {resumed / 'ckpt_0000002.pt'}" in out
    a, a_val = read_log(straight)
    b, b_val = read_log(resumed)
    assert b == {k: a[k] for k in (2, 3)} and b_val == {4: a_val[4]}
    sa = torch.load(straight / "ckpt_0000004.pt", weights_only=True)
    sb = torch.load(resumed / "ckpt_0000004.pt", weights_only=True)
    assert sb["model_config"] == sa["model_config"] and sb["model_config"]["dropout"] == 0.1
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])

    code, line = error_line([*run, "--resume", "--max_steps=5", f"--out_dir={resumed}",
                             "--n_head=4", "--dropout=0.0"], capsys)  # fmt: skip
    ckpt4 = resumed / "ckpt_0000004.pt"
    assert (code, line) == (2, f"config error: --n_head=4 contradicts {ckpt4} (n_head=2): "
                               "--resume continues its model, drop the flag")  # fmt: skip


def test_model_settings_that_may_differ_from_the_source():
    """init_from: dropout, the fast paths and the residual's precision are the new run's; a
    resume keeps the checkpoint's unless given (the residual's never changes)."""
    cfg = load_config(["--dropout=0.1", "--mlp_impl=torch", "--low_precision_residual=False"])
    source = {**vars(TrainConfig().model), "mlp_impl": "fast", "attn_impl": "torch"}
    source["low_precision_residual"] = True
    model = start.settle(cfg, source, "src", resuming=False)
    assert (model.dropout, model.mlp_impl, model.attn_impl) == (0.1, "torch", "fast")
    assert model.low_precision_residual is False
    with pytest.raises(ConfigError, match=r"^--low_precision_residual=False contradicts src"):
        start.settle(cfg, source, "src", resuming=True)
    cfg = load_config(["--dropout=0.1", "--mlp_impl=torch"])
    model = start.settle(cfg, source, "src", resuming=True)
    assert (model.dropout, model.mlp_impl, model.attn_impl) == (0.1, "torch", "torch")
    model = start.settle(load_config([]), source, "src", resuming=True)
    assert (model.dropout, model.mlp_impl, model.attn_impl) == (0.0, "fast", "torch")


def test_fp8_is_always_the_runs_own():
    """fp8 says how the blocks' GEMMs run, not what the weights are: a run takes its own (the
    default "off" when none is given), new or resumed, whatever its source was trained with."""
    source = {**vars(TrainConfig().model), "fp8": "tensorwise"}
    for resuming in (False, True):
        assert start.settle(load_config([]), source, "src", resuming).fp8 == "off"
        cfg = load_config(["--fp8=rowwise"])
        assert start.settle(cfg, source, "src", resuming).fp8 == "rowwise"
    assert start.resumed_settings(source)["fp8"] == "off"


def test_a_resume_on_another_world_size_says_so(exported, tiny_args, tmp_path, capsys):
    """A checkpoint written by 2 processes, resumed by 1: one note, and the run goes on."""
    ckpt = torch.load(exported.ckpt, weights_only=True)
    ckpt["rng"] = {k: v * 2 for k, v in ckpt["rng"].items()}  # as 2 ranks write it
    torch.save(ckpt, tmp_path / "ckpt_0000003.pt")
    capsys.readouterr()
    train.main([*tiny_args, "--resume", "--max_steps=4", f"--out_dir={tmp_path}"])
    assert (
        "written by 2 processes, resumed on 1: RNG re-seeded, the run is not bit-identical; "
        "tokens/step stay 256 (total_batch_size: gradient accumulation makes up)\n"
    ) in capsys.readouterr().out
    assert sorted(read_log(tmp_path)[0]) == [3]


@pytest.mark.parametrize(
    "saved, flags, says",
    [
        (
            {"batch_size": 4, "total_batch_size": 0},
            [],
            "tokens/step 256 -> 128 (one micro-batch a process; --total_batch_size=256 keeps them)",
        ),
        (
            {"batch_size": 4, "total_batch_size": 256},
            ["--total_batch_size=256"],
            "tokens/step stay 256 (total_batch_size: gradient accumulation makes up)",
        ),
        ({"batch_size": 2, "total_batch_size": 0}, [], "tokens/step stay 128"),
    ],
)
def test_a_resume_on_another_world_size_says_what_happens_to_tokens_a_step(saved, flags, says):
    """Written by 2 processes, resumed by 1 at micro-batch 4, T 32."""
    cfg = load_config(["--batch_size=4", "--block_size=32", *flags])
    procs = types.SimpleNamespace(world_size=1)
    note = start.world_size_note(cfg, saved, 2, procs)
    assert note == (
        f"written by 2 processes, resumed on 1: RNG re-seeded, the run is not bit-identical; {says}"
    )


def test_torchrun_ranks_start_from_the_same_weights(exported, tiny_data, tmp_path, capsys):
    """2 gloo processes under FSDP2 (each rank shards the weights it read; DDP and ZeRO-1
    broadcast rank 0's), one micro-batch each: the step-0 loss is the exported model's on the
    two batches of one process's step."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = [*RUN, f"--dataset={tiny_data}", f"--init_from={exported.hf}"]
    expected = transformers_loss(exported.hf, fresh_batches(tiny_data, 2))
    cmd = [*launcher, "train.py", *args, "--adamw_impl=torch", "--shard=full"]
    res = subprocess.run([*cmd, f"--out_dir={tmp_path}"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Traceback" not in out, out
    assert read_log(tmp_path)[0][0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8, tol", [("off", 0.02), ("fused", 0.1)])  # nats; FP8's: test_fp8.py
def test_gpu_init_from_with_the_fused_loss_bf16_and_fp8(exported, tiny_data, tmp_path, capsys,
                                                         fp8, tol):  # fmt: skip
    """On CUDA (bf16 autocast, the fused loss and the other fast paths, FP8 converting the loaded
    Linears): the step-0 loss is that of the exported model's plain fp32 forward on the CPU."""
    if fp8 != "off" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    args = [a for a in RUN if not a.startswith(("--device", "--dtype", "--loss_impl"))]
    args += ["--device=cuda", "--dtype=auto", f"--init_from={exported.hf}", f"--fp8={fp8}"]
    loss, batches, out = first_step(args, tiny_data, tmp_path, capsys)
    assert "| bfloat16 |" in out
    model = model_io.from_hf(exported.hf).eval()
    with torch.no_grad():
        ce = [F.cross_entropy(model(x.cpu(), all_positions=True).flatten(0, 1), y.cpu().flatten())
              for x, y in batches]  # fmt: skip
    assert abs(loss - torch.stack(ce).mean().item()) <= tol


def test_the_fine_tuning_recipe_runs(exported, tiny_data, tmp_path):
    """configs/finetune_gpt2.py from the exported weights at a tiny scale: its constant learning
    rate from the first step, a val loss every 5 steps and at the end."""
    recipe = os.path.join(REPO, "configs", "finetune_gpt2.py")
    scale = ["--batch_size=4", "--total_batch_size=256", "--val_tokens=512", "--max_steps=6"]
    where = [f"--init_from={exported.hf}", f"--dataset={tiny_data}", f"--out_dir={tmp_path}"]
    cpu = ["--device=cpu", "--dtype=float32", "--compile=False", "--loss_impl=torch"]
    train.main([recipe, *scale, *where, *cpu])
    log = [r for r in read_jsonl(tmp_path / "log.jsonl") if "lr" in r]
    assert [r["lr"] for r in log] == [3e-5] * 6
    assert sorted(read_log(tmp_path)[1]) == [0, 5, 6]
