"""--shard (data_parallel.py) under torchrun, gloo on CPU: ZeRO-1 and FSDP2 train DDP's curve.

Every run takes 768 tokens a step (B 4 x T 32 x W ranks x grad_accum: 3 micro-steps on 2 ranks,
2 on 3, 6 in one process), and the loader's order does not depend on W, so all of them see the
same batches and should train the same curve: ZeRO-1 bit for bit (the same update of the same
all-reduced grads, on the owning rank), FSDP2 and other world sizes to float rounding (grads
summed in another order, by reduce-scatter or over 3 ranks; the loss averaged over W): 1.6e-7
relative at most in these runs, 1e-5 allowed, as DDP's own test allows against one process.
"""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import sample
import train
from conftest import TINY, read_log, read_norms
from gpt2_fused.training import data_parallel
from gpt2_fused.training.config import ConfigError, TrainConfig
from gpt2_fused.training.distributed import Processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 20
RUNS = [("none", 2), ("optimizer", 2), ("full", 2), ("optimizer", 3), ("full", 3)]


def shard_args(dataset, out_dir, *extra):
    """train.py's arguments: TINY at width 64, 768 tokens a step, checkpoints at 10 and 20."""
    return [
        *TINY,
        f"--dataset={dataset}",
        "--n_embd=64",
        "--total_batch_size=768",
        "--val_tokens=768",  # the same validation tokens at every W too
        f"--max_steps={STEPS}",
        "--eval_interval=10",
        "--ckpt_interval=10",
        "--keep_last=0",
        "--sample_interval=0",
        f"--out_dir={out_dir}",
        *extra,
    ]


def torchrun(nproc, args):
    """train.py under torchrun with nproc gloo processes; its output."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launcher, f"--nproc_per_node={nproc}", "train.py", *args]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Traceback" not in out, out
    return out


def state_bytes(out):
    """The optimizer-state bytes of each rank, as train.py measured them after the run."""
    line = re.search(r"optimizer state by rank \(bytes\): (.*)", out).group(1)
    return [int(n.replace(",", "")) for n in line.split(" | ")]


def resumed_from(ckpt, out_dir):
    """out_dir holding only `ckpt` (a copy), for a --resume from it."""
    os.makedirs(out_dir)
    shutil.copy(ckpt, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """(mode, W) -> (out_dir, output) of a 20-step run from scratch, for each of RUNS."""
    base = tmp_path_factory.mktemp("shard")
    done = {}
    for mode, world in RUNS:
        out_dir = base / f"{mode}_{world}"
        done[mode, world] = (
            out_dir,
            torchrun(world, shard_args(tiny_data, out_dir, f"--shard={mode}")),
        )
    return done


@pytest.mark.parametrize("mode, world", RUNS[1:])
def test_sharded_losses_equal_ddp(runs, mode, world):
    ref, ref_val = read_log(runs["none", 2][0])
    got, got_val = read_log(runs[mode, world][0])
    assert sorted(got) == list(range(STEPS)) and sorted(got_val) == [0, 10, 20]
    if (mode, world) == ("optimizer", 2):
        assert got == ref and got_val == ref_val
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    for step in ref_val:
        assert got_val[step] == pytest.approx(ref_val[step], rel=1e-5), step
    assert got[STEPS - 1] < got[0] - 2  # it trained


def test_zero1_with_grads_summed_once_a_step_equals_ddp(runs, tiny_data, tmp_path):
    """ZeRO-1 with grad_sync="step" (the grads' one all-reduce after the backward, no DDP
    module: what CUDA graphs need under torchrun) trains as DDP does."""
    out = torchrun(2, shard_args(tiny_data, tmp_path, "--shard=optimizer", "--grad_sync=step"))
    assert "grads summed across ranks once a step" in out
    ref, ref_val = read_log(runs["none", 2][0])
    got, got_val = read_log(tmp_path)
    assert sorted(got) == list(range(STEPS)) and sorted(got_val) == [0, 10, 20]
    assert read_norms(tmp_path) == pytest.approx(read_norms(runs["none", 2][0]), rel=1e-5)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    for step in ref_val:
        assert got_val[step] == pytest.approx(ref_val[step], rel=1e-5), step


@pytest.mark.parametrize("mode, world", RUNS[1:])
def test_optimizer_state_per_rank_is_a_wth_of_ddps(runs, mode, world):
    """Measured: the bytes of the tensors in each rank's optimizer state. DDP keeps all of it on
    every rank. ZeRO-1 puts each parameter's state on one rank: the ranks' sum is DDP's, each
    within a few % of 1/W (whole tensors, largest first, to the least loaded rank). FSDP2 splits
    dim 0 in chunks of ceil(rows / W) (W = 3: 64 rows -> 22, 22, 20), so the first ranks hold a
    little more, and every rank keeps its own step counters (4 B for each of the 28 tensors)."""
    ddp = state_bytes(runs["none", 2][1])
    full = ddp[0]
    assert ddp == [full, full] and full > 1_000_000  # 2 moments x 4 B x 134,720 parameters
    mine = state_bytes(runs[mode, world][1])
    assert len(mine) == world
    if mode == "optimizer":
        assert sum(mine) == full
    else:
        assert sum(mine) == full + (world - 1) * 4 * 28
    assert max(mine) <= 1.02 * full / world and min(mine) >= 0.97 * full / world, mine


@pytest.mark.parametrize("mode, world", [("optimizer", 2), ("full", 2), ("full", 3)])
def test_stop_at_step_10_and_resume_continues_the_curve(runs, tiny_data, tmp_path, mode, world):
    """The step-10 checkpoint of the 2-rank run, resumed with --resume: on the same world size
    the same curve bit for bit (the RNG and data position come back too), on 3 ranks to float
    rounding (the data order continues at any world size; the state is full, each rank takes its
    part)."""
    src = runs[mode, 2][0]
    out = resumed_from(src / "ckpt_0000010.pt", tmp_path / "resumed")
    torchrun(world, shard_args(tiny_data, out, f"--shard={mode}", "--resume"))
    ref, ref_val = read_log(src)
    got, got_val = read_log(out)
    assert sorted(got) == list(range(10, STEPS)) and sorted(got_val) == [20]
    for step in got:
        if world == 2:
            assert got[step] == ref[step], step
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_a_sharded_checkpoint_is_ddps_format_and_loads_in_one_process(
    runs, tiny_data, tmp_path, capsys, mode
):
    """Rank 0 writes the full model and torch's own AdamW state dict (ids in param-group order),
    as DDP does: the same keys, weights and moments to float rounding. A single process (shard
    none, 6 micro-steps) resumes its step-10 checkpoint on the same curve, and sample.py reads
    it."""
    src = runs[mode, 2][0]
    ref = torch.load(runs["none", 2][0] / "ckpt_0000020.pt", weights_only=True)
    ckpt = torch.load(src / "ckpt_0000020.pt", weights_only=True)
    assert ckpt["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=1e-4, atol=1e-5)
    assert ckpt["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
    assert ckpt["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
    for i, s in ref["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):  # grads of the same scale: rounding in both
            torch.testing.assert_close(ckpt["optimizer"]["state"][i][k], s[k], rtol=1e-3, atol=1e-7)
        assert ckpt["optimizer"]["state"][i]["step"] == s["step"] == STEPS

    out = resumed_from(src / "ckpt_0000010.pt", tmp_path / "one")
    train.main(shard_args(tiny_data, out, "--resume"))
    want, _ = read_log(src)
    got, _ = read_log(out)
    assert sorted(got) == list(range(10, STEPS))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step

    capsys.readouterr()
    args = ["--ckpt", str(src), "--device", "cpu", "--prompt", "a", "--max-new-tokens", "8"]
    ids = sample.main([*args, "--num-samples", "2", "--temperature", "0"])
    assert ids.shape == (2, 9) and torch.equal(ids[0], ids[1])


def test_compiled_fsdp2_trains_like_ddp(runs, tiny_data, tmp_path):
    """shard=full with torch.compile (the whole FSDP2 model; Dynamo leaves FSDP2's hooks to eager
    mode) and the compile check at steps 0 and 11: DDP's curve, to Inductor's reordered fp32 sums
    (1e-4, as DDP's compiled test)."""
    out = tmp_path / "compiled"
    text = torchrun(2, shard_args(tiny_data, out, "--shard=full", "--compile=True"))
    assert "compile default" in text
    ref, _ = read_log(runs["none", 2][0])
    got, _ = read_log(out)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step


@pytest.mark.parametrize(
    "settings, device, says",
    [
        (dict(shard="zero"), "cpu", "one of ('none', 'optimizer', 'full'), not 'zero'"),
        (dict(shard="full"), "cuda", "pass --adamw_impl=torch"),
        (dict(shard="full", adamw_impl="torch", hellaswag=True), "cuda", "eval_hellaswag.py"),
        (dict(shard="full", ddp_compile="ddp"), "cpu", "FSDP2 has no DDP module"),
        (dict(compile_mode="reduce-overhead", grad_sync="ddp"), "cuda", "--grad_sync=step"),
        (
            dict(compile_mode="max-autotune", shard="full", adamw_impl="torch"),
            "cuda",
            "pass --compile_mode=default",
        ),
        (dict(compile_mode="reduce-overhead", ddp_compile="ddp"), "cuda", "CUDA graphs cannot"),
    ],
)
def test_combinations_that_do_not_run_are_refused_in_one_line(settings, device, says):
    procs = Processes(ddp=True, rank=0, local_rank=0, world_size=2, device=torch.device(device))
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        data_parallel.mode(TrainConfig(**settings), procs)
    assert "\n" not in str(e.value)


def test_cuda_graphs_under_torchrun_sum_the_grads_once_a_step():
    """compile_mode=auto may pick CUDA graphs under torchrun, and then the grads are summed
    once a step (grad_sync auto), except where DDP's buckets or FSDP2 must sum them."""
    cuda = Processes(ddp=True, rank=0, local_rank=0, world_size=2, device=torch.device("cuda"))
    one = Processes(ddp=False, rank=0, local_rank=0, world_size=1, device=torch.device("cuda"))
    cfg = TrainConfig(compile_mode="reduce-overhead")
    assert data_parallel.mode(cfg, cuda).name == "none"  # not refused
    assert data_parallel.graphs_fit(cfg) and data_parallel.sums_at_step(cfg, cuda, graphs=True)
    assert not data_parallel.sums_at_step(cfg, cuda, graphs=False)  # DDP without graphs
    assert not data_parallel.sums_at_step(cfg, one, graphs=True)  # one process: nothing to sum
    assert data_parallel.sums_at_step(TrainConfig(grad_sync="step"), cuda, graphs=False)
    for bucketed in (dict(grad_sync="ddp"), dict(ddp_compile="ddp"), dict(shard="full")):
        assert not data_parallel.graphs_fit(TrainConfig(**bucketed))
        assert not data_parallel.sums_at_step(TrainConfig(**bucketed), cuda, graphs=True)


def test_what_runs_with_sharding():
    """ZeRO-1 takes the Triton AdamW (it sees only the rank's own parameters); FSDP2 takes torch's
    (on a CPU adamw_impl="fast" is torch's anyway) and trains without printed samples."""
    cuda = Processes(ddp=True, rank=0, local_rank=0, world_size=2, device=torch.device("cuda"))
    cpu = Processes(ddp=True, rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    assert data_parallel.mode(TrainConfig(shard="optimizer", hellaswag=True), cuda).notes == []
    full = data_parallel.mode(
        TrainConfig(shard="full", adamw_impl="torch", sample_interval=0), cuda
    )
    assert full.notes == [] and not full.wraps_in_ddp and full.fully_sharded
    assert "no samples" in data_parallel.mode(TrainConfig(shard="full"), cpu).notes[0]


def test_sharding_outside_torchrun_says_how(tiny_args, tmp_path):
    with pytest.raises(ConfigError, match="torchrun --standalone --nproc_per_node=1"):
        train.main([*tiny_args, "--shard=optimizer", f"--out_dir={tmp_path}"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_each_mode_at_world_size_1_matches_ddp(tiny_data, tmp_path):
    """torchrun --nproc_per_node=1 on CUDA with the defaults (fused loss, cuBLASLt MLP, bf16
    autocast over fp32 weights), 8 steps of 4 micro-steps: ZeRO-1 with the Triton AdamW against
    DDP with it, eager and compiled (the compiled one through sharding's graph-cut correction);
    FSDP2 with torch's fused AdamW, eager and compiled, against DDP with that. At one rank the
    same math runs (gathers and reductions are copies) but the clip factor may differ in its
    last bit (the norm summed in another order; clipped in place, not by grad_scale), which can
    flip bf16 roundings of weights: 2e-4 allowed in eager mode; the compiled runs to bf16's
    compiled-against-eager noise (check_compile allows 2e-3 nats a step), 1e-2."""
    base = [a for a in TINY if not a.startswith(("--device", "--dtype", "--loss_impl"))]
    base += [f"--dataset={tiny_data}", "--device=cuda", "--total_batch_size=512"]
    base += ["--max_steps=8", "--eval_interval=4", "--ckpt_interval=0", "--sample_interval=0"]
    variants = {
        "ddp": [],
        "zero": ["--shard=optimizer"],
        "zero_compiled": ["--shard=optimizer", "--compile=True"],  # the graph-cut correction
        "ddp_torch": ["--adamw_impl=torch"],
        "fsdp": ["--shard=full", "--adamw_impl=torch"],
        "fsdp_compiled": ["--shard=full", "--adamw_impl=torch", "--compile=True"],
    }
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    procs = {}
    for name, extra in variants.items():  # together: tiny models share the GPU
        cmd = [*launcher, "train.py", *base, f"--out_dir={tmp_path / name}", *extra]
        procs[name] = subprocess.Popen(
            cmd, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    for name, proc in procs.items():
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0 and "Traceback" not in out, f"{name}:\n{out}"
        assert "bfloat16" in out and "grad_accum 4" in out, out
    logs = {name: read_log(tmp_path / name)[0] for name in variants}
    pairs = [("zero", "ddp", 2e-4), ("fsdp", "ddp_torch", 2e-4), ("fsdp_compiled", "ddp_torch", 0)]
    pairs += [("zero_compiled", "ddp", 0)]
    for name, ref, rel in pairs:
        for step in range(8):
            want = logs[ref][step]
            tol = dict(rel=rel) if rel else dict(abs=1e-2)
            assert logs[name][step] == pytest.approx(want, **tol), (name, step)


def test_inner_micro_steps_leave_fsdp2_grads_unreduced():
    """micro_step(sync=False) under FSDP2: the backward keeps the grads to itself (unsharded,
    inside FSDP2), no reduce-scatter, no .grad; the last micro-step's backward reduces all of
    them into .grad shards, and the clip's norm counts both micro-steps. One gloo rank."""
    import torch.distributed as dist

    from model import GPT, GPTConfig

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        cfg = GPTConfig(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2)
        cfg.n_embd, cfg.loss_impl = 32, "torch"
        torch.manual_seed(0)
        model, ref = GPT(cfg), GPT(cfg)
        ref.load_state_dict(model.state_dict())
        procs = Processes(ddp=True, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        full = data_parallel.mode(TrainConfig(shard="full", adamw_impl="torch"), procs)
        full.shard_model(model)
        x = torch.randint(0, 64, (2, 2, 16))
        for micro, sync in enumerate((False, True)):
            with full.micro_step(model, model, sync):
                model(x[micro], x[micro]).backward()
            ref(x[micro], x[micro]).backward()
            grads = [p.grad for p in model.parameters()]
            assert all(g is None for g in grads) if not sync else all(g is not None for g in grads)
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), float("inf"))
        want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), float("inf"))
        torch.testing.assert_close(norm.full_tensor(), want)
    finally:
        dist.destroy_process_group()


def test_zero1_compiled_graph_is_cut_where_ddps_is(monkeypatch):
    """torch.compile under DDP cuts the graph where DDP's gradient buckets end (Dynamo's
    DDPOptimizer). ZeRO-1's parameters are views into one bucket, and DDPOptimizer counted each
    as its whole storage: the graph was cut at nearly every parameter (76 subgraphs at 124M
    instead of DDP's 14). ZeRO1.make_optimizer corrects the count: ZeRO-1's cuts are DDP's,
    with the same bytes counted in each. One gloo rank, aot_eager (no Inductor)."""
    import torch.distributed as dist
    from torch._dynamo.backends.distributed import DDPOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from model import GPT, GPTConfig

    cuts = {}
    compile_fn = DDPOptimizer.compile_fn

    def spy(self, gm, example_inputs, **kw):
        out = compile_fn(self, gm, example_inputs, **kw)
        cuts[mode] = [(b.params, b.size) for b in self.buckets]
        return out

    monkeypatch.setattr(DDPOptimizer, "compile_fn", spy)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    wrapped = []  # the DDP modules (their reducers hold the group) until the group is gone
    try:
        cfg = GPTConfig(block_size=16, vocab_size=512, padded_vocab_size=512, n_layer=4, n_head=2)
        cfg.n_embd, cfg.loss_impl, cfg.mlp_impl = 128, "torch", "torch"  # 3.4 MB of weights
        x = torch.randint(0, 512, (2, 16))
        for mode in ("none", "optimizer"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = GPT(cfg)
            cfg_mode, cpu = TrainConfig(shard=mode), torch.device("cpu")
            procs = Processes(ddp=True, rank=0, local_rank=0, world_size=1, device=cpu)
            opt = data_parallel.mode(cfg_mode, procs).make_optimizer(model, cfg_mode, cpu)
            # 1 MB buckets (DDP's first bucket's size): DDP's own graph has cuts too
            wrapped.append(DDP(torch.compile(model, backend="aot_eager"), bucket_cap_mb=1))
            wrapped[-1](x, x).backward()
            opt.step()
        assert len(cuts["none"]) > 1
        assert cuts["optimizer"] == cuts["none"]  # the same parameters and bytes in each
    finally:
        torch._dynamo.reset()
        # as distributed.teardown: gloo's worker thread must free its last works (it takes the
        # GIL) before the group's destructor joins it, from a dealloc that holds the GIL
        dist.barrier()
        time.sleep(0.1)
        wrapped.clear()
        dist.destroy_process_group()
        time.sleep(0.1)
