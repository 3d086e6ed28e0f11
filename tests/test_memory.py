"""batch_size="auto" and the GPU cap (gpt2_fused/training/memory.py): the ladder under a fake
allocator, what total_batch_size allows, GPT2_FUSED_GPU_GB's parsing, the start-up line, the
probe leaving the run as it was, and an out-of-memory error later in the run; on a GPU, a capped
run and an auto run against the explicit one."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import train
from conftest import read_log
from gpt2_fused.training import config, memory
from gpt2_fused.training.checkpoint import list_checkpoints
from gpt2_fused.training.distributed import Processes
from gpt2_fused.training.optim import build_optimizer
from model import GPT, GPTConfig

GiB = 2**30
CPU = Processes(False, 0, 0, 1, torch.device("cpu"))


class FakeAllocator:
    """Bytes in use and a limit; an allocation past it raises torch's OutOfMemoryError, as the
    CUDA allocator does under set_per_process_memory_fraction. A block gives its bytes back
    when it is garbage (the probe's tensors going with the error's frames)."""

    def __init__(self, limit):
        self.limit, self.used = limit, 0

    def alloc(self, n):
        if self.used + n > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes.")
        self.used += n
        return FakeAllocator.Block(self, n)

    class Block:
        def __init__(self, owner, n):
            self.owner, self.n = owner, n

        def __del__(self):
            self.owner.used -= self.n


def fake_step(allocator, fixed, per_sequence):
    """A training step's allocations: fixed bytes, then per_sequence bytes per sequence in
    four pieces (a forward's layers), all alive at once."""

    def step(B):
        blocks = [allocator.alloc(fixed)]
        for _ in range(4):
            blocks.append(allocator.alloc(B * per_sequence // 4))

    return step


@pytest.mark.parametrize("limit, picked", [(10_000, 64), (5_000, 32), (1_500, 8), (300, 1)])
def test_ladder_picks_the_largest_rung_under_the_allocators_limit(limit, picked):
    """Each rung that does not fit fails at its first allocation past the limit; what it had
    allocated is released before the next rung, so the pick is the largest B with
    fixed + B * per_sequence <= limit (as a model of the bytes says)."""
    alloc = FakeAllocator(limit)
    step = fake_step(alloc, fixed=100, per_sequence=150)
    tried = []

    def fits(B):
        tried.append(B)
        ok = memory.try_rung(step, B)
        assert alloc.used == 0  # released, fitting or not
        return ok

    assert memory.first_fitting(memory.LADDER, fits) == picked
    expected = max(b for b in memory.LADDER if 100 + b * 150 <= limit)
    assert picked == expected and tried == [b for b in memory.LADDER if b >= picked]


def test_ladder_with_nothing_fitting_is_none():
    alloc = FakeAllocator(50)
    step = fake_step(alloc, fixed=100, per_sequence=10)
    assert memory.first_fitting(memory.LADDER, lambda B: memory.try_rung(step, B)) is None
    assert alloc.used == 0


@pytest.mark.parametrize(
    "total, T, world, fp8, rungs",
    [
        (0, 1024, 1, False, [64, 32, 16, 8, 4, 2, 1]),  # one micro-batch a step: any
        (524288, 1024, 8, False, [64, 32, 16, 8, 4, 2, 1]),  # 124M recipe on 8 GPUs
        (524288, 1024, 16, False, [32, 16, 8, 4, 2, 1]),  # 64 x 1024 x 16 > 2**19
        (131072, 512, 8, False, [32, 16, 8, 4, 2, 1]),  # TinyStories on 8 GPUs
        (3 * 1024, 1024, 1, False, [1]),  # 3 sequences a step: only 1 divides them
        (0, 8, 1, True, [64, 32, 16, 8, 4, 2]),  # fp8: B * T a multiple of 16
    ],
)
def test_allowed_rungs_divide_total_batch_size(total, T, world, fp8, rungs):
    assert memory.allowed_rungs(total, T, world, fp8) == rungs
    for b in rungs:  # each allowed rung gives a whole number of micro-steps
        assert total == 0 or config.grad_accum_steps(total, b, T, world) * b * T * world == total


def test_allowed_rungs_none_is_a_one_line_error():
    with pytest.raises(config.ConfigError, match="multiple of 1024") as e:
        memory.allowed_rungs(1000, 512, 2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, gib", [("24", 24), ("23.6", 23.6), (" 80 ", 80), ("", None)])
def test_cap_parses_gib(text, gib):
    assert memory.parse_cap(text) == (None if gib is None else int(gib * GiB))
    assert memory.parse_cap(None) is None


@pytest.mark.parametrize("text", ["abc", "0", "-4", "nan", "inf", "24GB"])
def test_cap_bad_value_is_a_one_line_config_error(text):
    with pytest.raises(config.ConfigError, match=f"{memory.CAP_ENV}=") as e:
        memory.parse_cap(text)
    assert "\n" not in str(e.value) and "e.g. GPT2_FUSED_GPU_GB=24" in str(e.value)


def test_bad_cap_stops_train_py_at_start_up(tiny_args, tmp_path, monkeypatch):
    """Checked on a CPU too (where it is not applied), before anything runs."""
    monkeypatch.setenv(memory.CAP_ENV, "lots")
    with pytest.raises(config.ConfigError, match="GPT2_FUSED_GPU_GB='lots'"):
        train.main(tiny_args + [f"--out_dir={tmp_path}", "--max_steps=1"])


def test_card_describes_itself():
    assert str(memory.Card(int(79.1 * GiB))) == "79.1 GiB card"
    card = memory.Card(int(79.1 * GiB), 24 * GiB)
    assert str(card) == "24.0 GiB cap of a 79.1 GiB card"
    assert card.usable == 24 * GiB and card.budget == int(24 * GiB * (1 - memory.HEADROOM))
    # another process holds most of the card: the pick counts only on what was free
    shared = memory.Card(80 * GiB, 24 * GiB, free=10 * GiB)
    assert (
        shared.usable == 10 * GiB
        and str(shared) == "24.0 GiB cap of a 80.0 GiB card, 10.0 GiB of it free"
    )
    assert memory.Card(80 * GiB, free=79 * GiB).usable == 79 * GiB
    assert str(memory.Card(80 * GiB, free=79 * GiB)) == "80.0 GiB card"


@pytest.mark.parametrize("argv, auto", [([], True), (["--batch_size='auto'"], True)])
def test_auto_is_the_default_and_eight_on_a_cpu(argv, auto):
    cfg = config.load_config(argv)
    assert cfg.batch_size == "auto"
    assert memory.pick_batch(cfg, CPU, None, None, torch.float32, None) == [
        "micro-batch 8 (auto, cpu)"
    ]
    assert cfg.batch_size == 8
    # a total_batch_size of 4 sequences allows 4 at most
    cfg = config.load_config(["--total_batch_size=512"])  # T 128
    memory.pick_batch(cfg, CPU, None, None, torch.float32, None)
    assert cfg.batch_size == 4


@pytest.mark.parametrize("value", ["0", "-2", "'big'", "2.0", "True"])
def test_batch_size_must_be_positive_or_auto(value):
    with pytest.raises(config.ConfigError, match="batch_size"):
        config.load_config([f"--batch_size={value}"])


def test_explicit_batch_size_is_kept():
    cfg = config.load_config(["--batch_size=3"])
    assert memory.pick_batch(cfg, CPU, None, None, torch.float32, None) == []
    assert cfg.batch_size == 3


def tiny_run(total_batch_size=0, dropout=0.1):
    """(cfg, model, optimizer) of a tiny model on the CPU, as train.py builds them."""
    model_cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=128,
                          padded_vocab_size=128, loss_impl="torch", dropout=dropout)  # fmt: skip
    cfg = config.TrainConfig(model=model_cfg, total_batch_size=total_batch_size)
    torch.manual_seed(0)
    model = GPT(model_cfg)
    return cfg, model, build_optimizer(model, cfg, torch.device("cpu"))


def probe_under(monkeypatch, limit_b):
    """memory.probe_step as it is, but a rung above limit_b raises an OutOfMemoryError after
    its forward and backward ran (as a budget crossed late in the backward would)."""
    real, tried = memory.probe_step, []

    def probe_step(model, cfg, dtype, hold_bytes):
        step = real(model, cfg, dtype, hold_bytes)

        def limited(B):
            tried.append((B, hold_bytes(B)))
            step(B)
            if B > limit_b:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU")

        return limited

    monkeypatch.setattr(memory, "probe_step", probe_step)
    monkeypatch.setattr(memory.Card, "limit", lambda self, n: None)  # no CUDA allocator here
    return tried


def test_pick_reports_card_and_why_and_leaves_the_run_as_it_was(monkeypatch):
    """The real probe's forward and backward (CPU, dropout on) for each rung from 64 down: the
    pick is the first that fits; the RNG, the weights and the optimizer are as before (so the
    run equals one given the pick), and no grads are left; the AdamW moments were held."""
    tried = probe_under(monkeypatch, 16)
    cfg, model, opt = tiny_run()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    card = memory.Card(int(79.1 * GiB), 24 * GiB)
    lines = memory.pick_batch(cfg, CPU, model, opt, torch.float32, card)
    assert lines == ["micro-batch 16 (auto, 24.0 GiB cap of a 79.1 GiB card; 32 needs more than "
                     "21.6 GiB)"]  # fmt: skip
    assert cfg.batch_size == 16 and [b for b, _ in tried] == [64, 32, 16]
    moments = 2 * 4 * sum(p.numel() for p in model.parameters())
    assert all(held == moments for _, held in tried)  # no CUDA graphs on a CPU: moments only
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_pick_says_when_total_batch_size_is_the_limit(monkeypatch):
    probe_under(monkeypatch, 64)
    cfg, model, opt = tiny_run(total_batch_size=4 * 16)
    lines = memory.pick_batch(cfg, CPU, model, opt, torch.float32, memory.Card(80 * GiB))
    assert lines == ["micro-batch 4 (auto, 80.0 GiB card; the largest that total_batch_size=64 "
                     "allows)"]  # fmt: skip


@pytest.mark.parametrize(
    "card_gib, fix",
    [
        (1e-5, "split them over"),  # the state itself does not fit: shard it
        (0.1, "--activation_memory_budget=0.5"),  # it does: the activations are too many
    ],
)
def test_nothing_fits_stops_with_one_line_naming_the_fix(monkeypatch, card_gib, fix):
    probe_under(monkeypatch, 0)
    cfg, model, opt = tiny_run()
    card = memory.Card(80 * GiB, int(card_gib * GiB))
    with pytest.raises(config.ConfigError, match="micro-batch 1 does not fit") as e:
        memory.pick_batch(cfg, CPU, model, opt, torch.float32, card)
    assert fix in str(e.value) and "\n" not in str(e.value)


def test_refusal_sizes_the_shards_from_the_state_bytes():
    """1558M on a 12 GiB card: 16 B a parameter is 23.2 GiB; 4 GPUs leave it 5.8 GiB each,
    under half the 10.8 GiB budget."""
    cfg = config.load_config(["--model=gpt2-xl"])
    n = 1_557_611_200
    msg = memory.refusal(cfg, memory.Card(80 * GiB, 12 * GiB), n, 4 * n, 8 * n, 1)
    assert "1,558M parameters' weights, grads and AdamW state take 23.2 GiB" in msg
    assert "over 8 or more such GPUs" in msg  # 23.2 / 4 = 5.8 > 10.8 / 2; / 8 fits


@pytest.mark.parametrize("where", ["evaluate", "sample_text"])
def test_oom_in_eval_or_sampling_saves_and_stops_with_one_line(tiny_args, tmp_path, monkeypatch,
                                                               where):  # fmt: skip
    """An OutOfMemoryError in the step-3 evaluation (or sample) of a single process: that step's
    checkpoint is written first (the state is whole between steps), the older one stays, the
    run ends with one line naming the setting to lower (SystemExit with a message: status 1),
    and resuming from it gives the uninterrupted run's losses (the sample's checkpoint is the
    same one)."""
    ref = tmp_path / "ref"
    args = tiny_args + ["--max_steps=5", "--eval_interval=3", "--sample_interval=3",
                        "--sample_tokens=4", "--ckpt_interval=2", "--keep_last=2"]  # fmt: skip
    train.main(args + [f"--out_dir={ref}"])
    real, out, calls = getattr(train, where), tmp_path / "out", []

    def fails_at_3(run, *a):  # evaluate(run, model) runs at steps 0, 3, 5; sample_text at 3
        calls.append(a)
        if (where == "evaluate" and len(calls) == 2) or a == (3,):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0")
        return real(run, *a)

    monkeypatch.setattr(train, where, fails_at_3)
    with pytest.raises(SystemExit) as e:
        train.main(args + [f"--out_dir={out}"])
    msg = e.value.code
    assert isinstance(msg, str) and "\n" not in msg  # printed; exit status 1
    what = "evaluation" if where == "evaluate" else "sampling"
    assert msg.startswith(f"error: out of memory in {what} (Tried to allocate 20.00 GiB)")
    newest = out / "ckpt_0000003.pt"
    assert f"saved this step's checkpoint: the newest checkpoint, {newest}, is intact" in msg
    fix = "--batch_size=2 --total_batch_size=256" if what == "evaluation" else "--sample_tokens=2"
    assert fix in msg
    names = [os.path.basename(p) for p in list_checkpoints(out)]
    assert names == ["ckpt_0000002.pt", "ckpt_0000003.pt"]
    if where == "sample_text":  # the same checkpoint as evaluation's: resumed once is enough
        return
    monkeypatch.undo()
    train.main(args + [f"--out_dir={out}", "--resume"])
    losses, _ = read_log(out)
    assert sorted(losses) == list(range(5)) and losses == read_log(ref)[0]


def test_oom_in_a_training_step_names_a_smaller_micro_batch(tiny_args, tmp_path, monkeypatch):
    """Mid-step nothing is saved (the data position moved); the newest checkpoint is named."""

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has")

    monkeypatch.setattr(GPT, "forward", oom)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args + [f"--out_dir={tmp_path}", "--max_steps=1", "--eval_interval=0"])
    msg = e.value.code
    assert msg.startswith("error: out of memory in training (Tried to allocate 2.00 MiB)")
    assert f"no checkpoint has been saved in {tmp_path}" in msg and "--batch_size=2" in msg


def cuda_run(tmp_path, name, monkeypatch, cap=None, extra=()):
    """train.main of 124M on random-ish tokens for 3 steps, eager (a compile per run would take
    a minute), under GPT2_FUSED_GPU_GB=cap; returns (peak GiB, losses)."""
    from bench.throughput import random_dataset
    from data.prepare import CACHE_DIR

    if cap is None:
        monkeypatch.delenv(memory.CAP_ENV, raising=False)
    else:
        monkeypatch.setenv(memory.CAP_ENV, str(cap))
    data = random_dataset(str(CACHE_DIR / "random"), 1 << 24)
    out = tmp_path / name
    torch.cuda.reset_peak_memory_stats()
    train.main(["--model=gpt2", f"--dataset={data}", "--max_steps=3", "--eval_interval=0",
                "--sample_interval=0", "--ckpt_interval=0", "--compile=False", "--dropout=0.1",
                "--val_tokens=8192", f"--out_dir={out}", *extra])  # fmt: skip
    losses = [loss for _, loss in sorted(read_log(out)[0].items())]
    return torch.cuda.max_memory_allocated() / GiB, losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cap_picks_a_smaller_micro_batch_and_auto_equals_explicit(
    tmp_path, monkeypatch, capsys
):
    """124M, eager, dropout on: a 16 GiB cap picks more than an 8 GiB cap does; the capped run
    trains within its cap, and equals (same losses) the run given its pick explicitly. Caps both:
    the gate runs the GPU tests in 4 processes on one card, and an uncapped probe (90 % of it)
    and the run it picks would leave the others' tests out of memory."""
    try:
        capped_and_explicit(tmp_path, monkeypatch, capsys)
    finally:  # the cap outlives train.main in this process: the next GPU tests get the card
        torch.cuda.set_per_process_memory_fraction(1.0)


def capped_and_explicit(tmp_path, monkeypatch, capsys):
    peak, _ = cuda_run(tmp_path, "larger", monkeypatch, cap=16)
    larger = re.search(r"micro-batch (\d+) \(auto, 16\.0 GiB cap", capsys.readouterr().out)
    assert larger and peak <= 16
    peak, auto = cuda_run(tmp_path, "capped", monkeypatch, cap=8)
    text = capsys.readouterr().out
    line = re.search(r"micro-batch (\d+) \(auto, 8\.0 GiB cap of a [\d.]+ GiB card; .*", text)
    assert line, text
    picked = int(line.group(1))
    assert picked < int(larger.group(1)) and peak <= 8
    _, explicit = cuda_run(tmp_path, "explicit", monkeypatch, cap=8,
                           extra=[f"--batch_size={picked}"])  # fmt: skip
    assert all(x == x for x in auto) and len(auto) == 3
    # the same run twice on a GPU differs by ~5e-5 (bf16 atomics in the backward)
    torch.testing.assert_close(auto, explicit, rtol=0, atol=2e-4)


def test_memory_fit_rehearsal_prints_a_row_per_card(tmp_path, capsys):
    """bench/memory_fit.py's --cpu rehearsal: each card's auto run (8 on a CPU) and one
    uncapped run of that micro-batch, shared by both cards; the table's rows, and a refusal's."""
    from bench import memory_fit

    argv = ["--cpu", "--recipes=tinystories", "--cards=12,80", "--steps=2", "--warmup=1"]
    save = train.save_checkpoint
    memory_fit.main([*argv, f"--out={tmp_path}"])
    assert train.save_checkpoint is save  # the tests after this one write real checkpoints
    saved = json.loads((tmp_path / "memory_fit.json").read_text())
    rows = saved["rows"]
    assert (
        saved["caption"].startswith("cpu, torch ") and "eager (--compile=False)" in saved["caption"]
    )
    assert capsys.readouterr().out.endswith(memory_fit.table(rows, saved["caption"]) + "\n")
    assert [(r["card_gb"], r["batch"]) for r in rows] == [(12, 8), (80, 8)]
    assert len(list((tmp_path / "runs").glob("*_uncapped"))) == 1
    for r in rows:
        assert r["tok_per_s"] > 0 and r["ratio"] == r["tok_per_s"] / r["uncapped_tok_per_s"]
    refusal = dict(recipe="1558m", card_gb=12, error="config error: micro-batch 1 does not fit")
    text = memory_fit.table([*rows, refusal], "caption").splitlines()
    assert text[0] == "caption" and len(text) == 7
    assert re.fullmatch(r"\| tinystories \| 12 \| 8 \| [\d,]+ \| 0\.0 \| [\d,]+ \| [\d.]+x \|",
                        text[4])  # fmt: skip
    assert text[6] == "| 1558m | 12 | stops: config error: micro-batch 1 does not fit | | | | |"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "extra",
    [
        ["--shard='full'", "--adamw_impl='torch'", "--compile=False"],
        ["--fp8='fused'", "--compile=True"],
    ],
    ids=["fsdp2_eager", "fp8_fused_compiled"],
)
def test_gpu_auto_under_torchrun(tmp_path, extra):
    """batch_size=auto in a torchrun process (NCCL, one rank: the all_reduce of each verdict
    runs) with FSDP2, and with FP8 compiled (CUDA graphs where compile_mode auto picks them),
    124M under an 8 GiB cap: the run picks a rung, says so in one line, and trains 3 steps."""
    from bench.throughput import random_dataset
    from data.prepare import CACHE_DIR

    data = random_dataset(str(CACHE_DIR / "random"), 1 << 24)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "train.py", "--model=gpt2", f"--dataset={data}", "--max_steps=3", "--eval_interval=0",
           "--sample_interval=0", "--ckpt_interval=0", "--val_tokens=8192", f"--out_dir={out}",
           *extra]  # fmt: skip
    env = {**os.environ, memory.CAP_ENV: "8"}
    repo = os.path.dirname(train.__file__)
    res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"micro-batch \d+ \(auto, 8\.0 GiB cap of a [\d.]+ GiB card", res.stdout)
    losses = list(read_log(out)[0].values())
    assert len(losses) == 3 and all(x == x and x < 12 for x in losses)
