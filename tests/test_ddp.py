"""2-process DDP (gloo, CPU) under torchrun == 1 process with twice the gradient accumulation."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from conftest import read_log, read_norms
from data.loader import DataLoader
from data.shards import write_shard
from gpt2_fused.training import checkpoint, compile_guard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun_2(*args):
    """Command line: train.py under torchrun with 2 processes on this machine."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return [*launcher, "train.py", *args]


def assert_same_run(single, multi, steps, val_steps, rel=1e-5, norm_rel=1e-5):
    """The run in `multi` logged the train losses, validation losses and grad norms (the one
    figure that shows grads off by a constant factor) of the run in `single`, at steps
    0..steps-1 and val_steps: to fp32 summation order by default (bf16 and atomics on a GPU:
    the same run twice is not bit-identical)."""
    a, a_val = read_log(single)
    b, b_val = read_log(multi)
    assert sorted(b) == list(range(steps)) and sorted(b_val) == val_steps
    norms = read_norms(single)  # the mean of the ranks' grads, not their sum
    assert read_norms(multi) == pytest.approx(norms, rel=norm_rel) and len(norms) == steps
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=rel, abs=1e-6), step
    for step in a_val:
        assert b_val[step] == pytest.approx(a_val[step], rel=rel, abs=1e-6), step


def cuda_args(tiny_args):
    """tiny_args on the GPU: bf16 autocast, compiled (train.py's defaults there)."""
    args = [a for a in tiny_args if not a.startswith(("--device", "--dtype", "--compile"))]
    return [*args, "--device=cuda", "--dtype=auto"]


@pytest.mark.parametrize(
    "options",
    [[], ["--softcap=30", "--z_loss=1e-3"], ["--grad_sync=step"]],
    ids=["plain", "loss_options", "grads_summed_at_step"],
)
def test_ddp_matches_single_process_accumulation(tiny_args, tmp_path, options):
    # total_batch_size 256 = B 4 x T 32 x (1 rank x 2 micro-steps | 2 ranks x 1 micro-step): the
    # same tokens per step, as the loader gives rank r the windows after rank r-1's in an order
    # (shuffled by default) that does not depend on the world size
    args = tiny_args + ["--max_steps=6", "--eval_interval=3", "--ckpt_interval=3"] + options
    single, multi = tmp_path / "single", tmp_path / "ddp"
    train.main(args + [f"--out_dir={single}"])

    cmd = torchrun_2(*args, f"--out_dir={multi}")
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "grad_accum 1 = 256" in out and "x 2 processes | float32" in out
    assert out.count("config:") == 1  # rank 0 alone prints (and writes)
    assert "Traceback" not in out
    assert ("grads summed across ranks once a step" in out) == ("--grad_sync=step" in options)

    assert_same_run(single, multi, 6, [0, 3, 6])
    ckpt = torch.load(multi / "ckpt_0000006.pt", weights_only=True)
    assert len(ckpt["rng"]["torch"]) == 2  # each rank's RNG, for an exact resume
    ref = torch.load(single / "ckpt_0000006.pt", weights_only=True)
    for k, v in ref["model"].items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=1e-4, atol=1e-5)


def test_default_total_batch_follows_the_world_size(tiny_args, tmp_path):
    """total_batch_size left at its default (0): under torchrun each process takes one
    micro-batch a step, and the header says so; no settings error."""
    args = [a for a in tiny_args if not a.startswith("--total_batch_size")]
    cmd = torchrun_2(*args, "--max_steps=2", "--eval_interval=0", f"--out_dir={tmp_path}")
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "x world_size 2 x grad_accum 1 = 256 (total_batch_size=0: one micro-batch" in out
    assert sorted(read_log(tmp_path)[0]) == [0, 1]


def test_ddp_compiled_as_one_module_matches_single_process(tiny_args, tmp_path):
    """--ddp_compile=ddp (DDP wrapped first, then compiled: Dynamo splits the graph at the
    gradient buckets) trains like one uncompiled process with twice the accumulation; 2 micro-steps
    per rank, so no_sync() on the compiled module is used too. Inductor's CPU backend here; it
    reorders fp32 sums, hence the looser tolerance than above."""
    args = tiny_args + ["--max_steps=4", "--eval_interval=2", "--ckpt_interval=0"]
    args += ["--total_batch_size=512"]
    single, multi = tmp_path / "single", tmp_path / "ddp"
    train.main(args + [f"--out_dir={single}"])
    extra = ["--compile=True", "--ddp_compile=ddp", f"--out_dir={multi}"]
    res = subprocess.run(
        torchrun_2(*args, *extra), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "grad_accum 2 = 512" in out and "Traceback" not in out
    a, a_val = read_log(single)
    b, b_val = read_log(multi)
    assert sorted(b) == list(range(4)) and sorted(b_val) == [0, 2, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    for step in a_val:
        assert b_val[step] == pytest.approx(a_val[step], rel=1e-4), step


def test_grads_summed_once_a_step_train_as_ddp_and_one_process_do(tiny_args, tmp_path):
    """--grad_sync=step (no DDP module: rank 0's weights broadcast, the grads kept in one flat
    buffer, one all-reduce after the step's last backward; what CUDA graphs need under
    torchrun) with 2 micro-steps per rank: the losses, validation losses and final weights of
    one process with 4 micro-steps (an independent path: no process group at all), and a resume
    from its step-2 checkpoint continues the same curve."""
    args = tiny_args + ["--max_steps=4", "--eval_interval=2", "--ckpt_interval=2"]
    args += ["--total_batch_size=512"]
    single, multi = tmp_path / "single", tmp_path / "step"
    train.main(args + [f"--out_dir={single}"])
    cmd = torchrun_2(*args, "--grad_sync=step", f"--out_dir={multi}")
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "grad_accum 2 = 512" in out and "grads summed across ranks once a step" in out
    assert "Traceback" not in out
    assert_same_run(single, multi, 4, [0, 2, 4])
    ref = torch.load(single / "ckpt_0000004.pt", weights_only=True)
    got = torch.load(multi / "ckpt_0000004.pt", weights_only=True)
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-4, atol=1e-5)

    os.remove(multi / "ckpt_0000004.pt")  # resume from step 2 and train steps 2-3 again
    with open(multi / "log.jsonl") as f:
        kept = [line for line in f if json.loads(line)["step"] <= 2]
    with open(multi / "log.jsonl", "w") as f:
        f.writelines(kept)
    cmd = torchrun_2(*args, "--grad_sync=step", f"--out_dir={multi}", "--resume")
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert_same_run(single, multi, 4, [0, 2, 4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_torchrun_runs_cuda_graphs_with_evals_samples_and_resume(tiny_args, tmp_path):
    """Under torchrun (1 process, NCCL) compile_mode=auto records CUDA graphs at this size and
    the grads are summed once a step (grad_sync auto): four micro-steps a step, evaluations, a
    sample and checkpoints, then a resume; the losses and grad norms are those of the same run
    in one process without torchrun (which keeps its grads the same way, with no all-reduce;
    that kept grads stay views of the flat buffer under graphs is tests/test_train.py's)."""
    args = [*cuda_args(tiny_args), "--total_batch_size=512"]
    args += ["--eval_interval=2", "--sample_interval=3", "--ckpt_interval=3"]
    single, multi = tmp_path / "single", tmp_path / "torchrun"
    train.main([*args, "--max_steps=6", f"--out_dir={single}"])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launcher, "--nproc_per_node=1", "train.py", *args, "--max_steps=6"]
    res = subprocess.run([*cmd, f"--out_dir={multi}"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, check=False)  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "compile reduce-overhead" in out and "grads summed across ranks once a step" in out
    assert "sample at step 3" in out
    a, a_val = read_log(single)
    b, b_val = read_log(multi)
    assert sorted(b) == list(range(6)) and sorted(b_val) == [0, 2, 4, 6]
    for step in a:  # bf16 and atomics: the same run twice is not bit-identical
        assert b[step] == pytest.approx(a[step], rel=2e-3), step
    assert read_norms(multi) == pytest.approx(read_norms(single), rel=2e-2)
    cmd[-1] = "--max_steps=8"
    res = subprocess.run([*cmd, f"--out_dir={multi}", "--resume"], cwd=REPO, capture_output=True,
                         text=True, timeout=600, check=False)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resumed from" in res.stdout + res.stderr
    b, b_val = read_log(multi)
    assert sorted(b) == list(range(8)) and sorted(b_val) == [0, 2, 4, 6, 8]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("grad_sync", ["auto", "ddp"])
def test_gpu_two_ranks_train_as_one_process_with_twice_the_accumulation(tiny_args, tmp_path,
                                                                        grad_sync):  # fmt: skip
    """torchrun with 2 processes on 2 GPUs (NCCL), with evaluations and a checkpoint: "auto"
    records CUDA graphs and sums the grads once a step, "ddp" runs DDP without graphs. Both
    follow one process with twice the accumulation (no process group at all), losses, grad
    norms and final weights."""
    args = [*cuda_args(tiny_args), "--total_batch_size=512", "--max_steps=6"]
    args += ["--eval_interval=2", "--ckpt_interval=6", f"--grad_sync={grad_sync}"]
    single, multi = tmp_path / "single", tmp_path / "torchrun"
    train.main([*args, f"--out_dir={single}"])
    res = subprocess.run([*torchrun_2(*args), f"--out_dir={multi}"], cwd=REPO, capture_output=True,
                         text=True, timeout=600, check=False)  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    # the start-up report names the GPU and the world size (on CPU: "... x 2 processes")
    assert f"{torch.cuda.get_device_name(0)} x 2 |" in out and "Traceback" not in out
    graphs = grad_sync == "auto"
    assert ("compile reduce-overhead" in out) == graphs
    assert ("grads summed across ranks once a step" in out) == graphs
    assert_same_run(single, multi, 6, [0, 2, 4, 6], rel=2e-3, norm_rel=2e-2)
    ref = torch.load(single / "ckpt_0000006.pt", weights_only=True)["model"]
    got = torch.load(multi / "ckpt_0000006.pt", weights_only=True)["model"]
    for k, v in ref.items():  # AdamW's first steps move every weight by ~lr, so relative norms
        assert (got[k] - v).norm() <= 1e-2 * v.norm(), k


def test_ddp_sigterm_to_torchrun_saves_then_resumes_on_one_process(tiny_args, tmp_path):
    """torchrun forwards SIGTERM to both workers; they agree on a step, rank 0 saves, both exit.
    The checkpoint then resumes in a single process (the data position carries over)."""
    out = tmp_path / "out"
    args = tiny_args + [f"--out_dir={out}", "--eval_interval=0", "--ckpt_interval=0"]
    cmd = torchrun_2(*args, "--max_steps=100000")
    proc = subprocess.Popen(
        cmd, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    log = out / "log.jsonl"
    t0 = time.time()
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the torchrun agent, as a scheduler would
    text = proc.communicate(timeout=120)[0]
    assert text.count("signal 15: finishing this step") == 1, text  # rank 0 says it for both
    assert text.count("saved ") == 1, text
    ckpts = checkpoint.list_checkpoints(out)
    assert len(ckpts) == 1, text
    step = torch.load(ckpts[0], weights_only=True)["step"]
    assert max(read_log(out)[0]) == step - 1

    train.main(args + [f"--max_steps={step + 2}", "--resume"])
    losses, _ = read_log(out)
    assert sorted(losses) == list(range(step + 2))


def test_ddp_ctrl_c_saves_once_and_only_torchrun_complains(tiny_args, tmp_path):
    """Ctrl-C in a terminal: SIGINT to torchrun's whole process group. The workers finish their
    step and rank 0 saves once; no worker prints a traceback. torchrun itself then raises its
    SignalException (its own handler: README says so)."""
    out = tmp_path / "out"
    args = tiny_args + [f"--out_dir={out}", "--eval_interval=0", "--ckpt_interval=0"]
    proc = subprocess.Popen(
        torchrun_2(*args, "--max_steps=100000"), cwd=REPO, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log = out / "log.jsonl"
    t0 = time.time()
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()[0]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    text = proc.communicate(timeout=120)[0]
    assert text.count("saved ") == 1 and len(checkpoint.list_checkpoints(out)) == 1, text
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text
    assert text.count("Traceback") <= 1 and ("Traceback" not in text or "SignalException" in text)


LOADER_RANKS = """
import sys
import torch
import torch.distributed as dist
from data.loader import DataLoader

dist.init_process_group("gloo")
pattern, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
loader = DataLoader(pattern, 3, 8, dist.get_rank(), dist.get_world_size(), seed=11)
mine = torch.stack([loader.next_batch()[0][:, 0] for _ in range(steps)])  # (steps, B) first ids
every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
dist.all_gather(every, mine)
if dist.get_rank() == 0:
    torch.save(torch.stack(every, dim=1), out)  # (steps, W, B)
dist.destroy_process_group()
"""


def test_ddp_ranks_draw_disjoint_windows_that_cover_the_epoch(tmp_path):
    """Two gloo processes under torchrun, each with its own shuffled DataLoader, over one epoch:
    no window twice across ranks and steps, all windows but each shard's tail (< B*W) drawn, and
    the same windows a single process with both ranks' loaders draws."""
    write_shard(tmp_path / "c_train_000001.bin", np.arange(1000))  # token = position: 124 windows
    write_shard(tmp_path / "c_train_000002.bin", np.arange(1000, 1401))  # 50 windows of T = 8
    pattern, steps = str(tmp_path / "c_train_*.bin"), 124 // 6 + 50 // 6  # B*W = 3*2
    script = tmp_path / "loader_ranks.py"
    script.write_text(LOADER_RANKS)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*launcher, str(script), pattern, str(steps), str(tmp_path / "firsts.pt")]
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    firsts = torch.load(tmp_path / "firsts.pt", weights_only=True)
    flat = firsts.reshape(-1).tolist()
    assert len(set(flat)) == len(flat) == steps * 6  # disjoint
    first_shard = [f for f in flat if f < 1000]
    assert len(first_shard) == 120 and all(f % 8 == 0 for f in first_shard)  # 124 - tail of 4
    assert len(flat) - len(first_shard) == 48  # 50 - tail of 2
    assert all((f - 1000) % 8 == 0 for f in flat if f >= 1000)
    assert sorted(flat) != flat  # shuffled
    sim = [DataLoader(pattern, 3, 8, r, 2, seed=11) for r in range(2)]
    for step in range(steps):
        for r in range(2):
            assert torch.equal(sim[r].next_batch()[0][:, 0], firsts[step, r])


def test_compiled_loss_check_agrees_across_ranks():
    """Under DDP the compile check takes the largest gap over ranks, so every rank decides the
    same (here one gloo rank: the all-reduce path runs; the decision is the same)."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        check = compile_guard.compiled_loss_mismatch
        assert check(torch.tensor(2.5), torch.tensor(2.5005), True, "batch") is None
        wrong = check(torch.tensor(2.6), torch.tensor(2.5), True, "batch")
        assert "compiled 2.600000, eager 2.500000" in wrong and "1.00e-01 nats" in wrong
        assert check(torch.tensor(float("nan")), torch.tensor(2.5), True, "batch") is not None
    finally:
        dist.destroy_process_group()


def test_exit_if_launched_leaves_only_under_torchrun(monkeypatch):
    """After a clean end under torchrun the process leaves through os._exit(0), skipping the
    interpreter's finalisation (where gloo's threads once aborted a finished rank); outside
    torchrun it returns and the interpreter ends as usual."""
    from gpt2_fused.training import distributed

    calls = []
    monkeypatch.setattr(distributed.os, "_exit", lambda code: calls.append(code))
    monkeypatch.delenv("RANK", raising=False)
    distributed.exit_if_launched()
    assert calls == []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    distributed.exit_if_launched()
    assert calls == [0]
