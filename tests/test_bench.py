"""The benchmark scripts' own arithmetic (no GPU): step statistics, the first-loss check,
bench_fused_loss's --set parsing, the loss variants' launch settings, bench_adamw's Triton AdamW
against torch's (in the Triton interpreter, see conftest.py), parity.py's reference sampler,
peer_nanogpt's handling of a missing or broken checkout, and that bench/__init__ lists every
benchmark."""

import json
import os
import pathlib
import re

import numpy as np
import pytest
import torch

import bench
from bench import (
    bench_adamw,
    bench_fused_loss,
    bench_muon,
    common,
    parity,
    peer_nanogpt,
    shard_memory,
    throughput,
)
from fused_loss import linear_cross_entropy as fl


def run(model, batch, loss_first, rc=0, impl="default"):
    return dict(model=model, batch=batch, impl=impl, rc=rc, loss_first=loss_first)


def test_first_loss_outliers_flags_only_the_odd_run_within_its_group():
    runs = [
        run("1558M", 16, 11.14596),
        run("1558M", 16, 11.14593, impl="torch"),
        run("1558M", 16, 11.11713),  # a wrongly compiled graph
        run("124M", 32, 10.97365),
        run("124M", 64, 10.95012),  # another batch: other tokens, another first loss
        run("124M", 32, 99.0, rc=1),  # failed runs have no loss to compare
    ]
    assert throughput.first_loss_outliers(runs) == [runs[2]]
    assert throughput.first_loss_outliers(runs[:2] + runs[3:]) == []


def test_step_stats_medians_after_warmup(tmp_path):
    log = tmp_path / "log.jsonl"
    recs = [dict(step=0, loss=11.0, ms=9000.0, tok_per_s=10.0, mfu=0.01)]
    recs += [
        dict(step=s, loss=10.0 - s, ms=100.0 + s, tok_per_s=1000.0 - s, mfu=0.4) for s in (1, 2, 3)
    ]
    recs[1]["startup_s"] = 42.5  # train.py's start-up time rides on step 1's record
    recs.append(dict(step=3, val_loss=9.5))  # eval records carry no timing
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    st = throughput.step_stats(str(log), warmup=1)
    want = dict(ms=102.0, tok_per_s=998.0, mfu=0.4, loss_first=11.0, loss_last=7.0)
    assert st == dict(want, startup_s=42.5)


@pytest.mark.parametrize("scale", [1e-3, 1e2])  # the clip idle (norm ~0.07), then cutting
def test_bench_adamw_kernel_matches_torch_clip_and_adamw(scale):
    shapes, wds = [(37, 19), (5000,), (3,)], [0.1, 0.0, 0.0]  # ragged: partial blocks
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(s, generator=gen) for s in shapes]
    ours = [p.clone() for p in ref]
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(ref, wds, strict=True)]
    b = bench_adamw
    torch_opt = torch.optim.AdamW(groups, lr=b.LR, betas=b.BETAS, eps=b.EPS)
    triton_opt = b.TritonAdamW(ours, wds, block=1024)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) * scale for s in shapes]
        for p, q, g in zip(ref, ours, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, b.MAX_NORM)
        torch_opt.step()
        coef = b.clip_coef([q.grad for q in ours], b.MAX_NORM)
        assert (coef < 1) == (norm > b.MAX_NORM) == (scale > 1)
        triton_opt.step(coef)
    for p, q, m in zip(ref, ours, triton_opt.m, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, torch_opt.state[p]["exp_avg"], rtol=1e-6, atol=1e-9)


def test_bench_fused_loss_set_parses_each_value_as_its_option_type():
    config = dict(per_sm=4, cap_regs=True, order="pass1_back", single_read="auto")
    parsed = bench_fused_loss.parse_set(
        "per_sm=3,cap_regs=False,order=forward,single_read=True", config
    )
    assert parsed == dict(per_sm=3, cap_regs=False, order="forward", single_read=True)
    assert bench_fused_loss.parse_set("", config) == {}
    for bad in ("per_sm", "warps=8", "cap_regs=no", "per_sm=x"):
        with pytest.raises((SystemExit, ValueError)):
            bench_fused_loss.parse_set(bad, config)


def test_loss_variants_set_the_launch_for_their_block_only():
    """common.variant goes through fl.launch_settings: the variant's values inside, the library's
    after (an error in the block too); a key LAUNCH does not have is refused, nothing changed."""
    launch, extra = dict(fl.LAUNCH["cuda"]), fl.EXTRA_BYTES
    with common.variant("extra640"):
        assert fl.EXTRA_BYTES == 640 * common.MiB and fl.LAUNCH["cuda"] == launch
    with pytest.raises(RuntimeError), common.variant("w16_sm2"):
        assert fl.LAUNCH["cuda"] == dict(launch, per_sm=2, num_warps=16)
        assert fl.EXTRA_BYTES == extra
        raise RuntimeError
    assert (fl.LAUNCH["cuda"], fl.EXTRA_BYTES) == (launch, extra)
    with pytest.raises(KeyError, match="per_smm"), fl.launch_settings(per_smm=2, extra_bytes=1):
        pass
    assert (fl.LAUNCH["cuda"], fl.EXTRA_BYTES) == (launch, extra)


def test_bench_fused_loss_repeats_take_turns_and_ratio_within_each_repeat():
    """--repeats: every round times each method once, in order; a row's times are medians over
    the rounds and its ratio the median of per-round ratios to the base method; a method that
    raises keeps its error row while the others go on."""
    order, drift = [], iter(range(100))

    def time_one(name):  # the prepared "timers" are the method's name here
        order.append(name)
        slow = next(drift)  # the machine gets slower with every timing
        if name == "flaky" and len(order) > 4:
            raise RuntimeError("boom")
        speed = {"compile": 10.0, "ours": 8.0, "flaky": 20.0}[name]
        return dict(fwd_bwd_ms=speed + slow, fwd_ms=1.0, gpu_ms=speed * (1 + slow / 100))

    prepared = {
        "compile": ("compile", dict(peak_mib=1.0)),
        "missing": dict(error="did not import"),
        "ours": ("ours", dict(peak_mib=2.0)),
        "flaky": ("flaky", dict(peak_mib=3.0)),
    }
    rows = bench_fused_loss.interleaved(prepared, 3, time_one, "compile")
    assert order == ["compile", "ours", "flaky", "compile", "ours", "flaky", "compile", "ours"]
    assert list(rows) == ["compile", "missing", "ours", "flaky"]
    assert rows["missing"] == dict(error="did not import")
    assert "boom" in rows["flaky"]["error"] and rows["flaky"]["failed_repeat"] == 1
    ours = rows["ours"]
    assert ours["fwd_bwd_ms_each"] == [9.0, 12.0, 15.0] and ours["fwd_bwd_ms"] == 12.0
    assert ours["repeats"] == 3 and ours["peak_mib"] == 2.0
    walls = [(8 + k) / (10 + k - 1) for k in (1, 4, 7)]  # ours after compile in each round
    assert ours["wall_vs_compile"] == pytest.approx(sorted(walls)[1])
    assert rows["compile"]["wall_vs_compile"] == rows["compile"]["gpu_vs_compile"] == 1.0


def test_throughput_keeps_the_allocators_words_on_out_of_memory():
    out = (
        "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 23.02 GiB. "
        "GPU 0 has a total capacity of 139.81 GiB of which 12.50 GiB is free. Including "
        "non-PyTorch memory, this process has 127.30 GiB memory in use. Of the allocated memory "
        "110.20 GiB is allocated by PyTorch, and 15.10 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting ...\n"
    )
    detail = throughput.oom_detail(out)
    assert detail.startswith("Tried to allocate 23.02 GiB") and "127.30 GiB memory in use" in detail
    assert detail.endswith("15.10 GiB is reserved by PyTorch but unallocated.")
    assert throughput.oom_detail("RuntimeError: something else") == ""


def test_throughput_summary_takes_medians_and_the_ratio_to_plain():
    """--repeats: one row per configuration with the median of its runs, and tok/s and peak
    memory over the plain configuration's of the same model and batch."""

    def r(impl, tok, peak, rc=0, model="124M"):
        stats = dict(ms=1e3 / tok, tok_per_s=tok, peak_gib=peak, loss_first=11.0, loss_last=10.0)
        stats["startup_s"] = 40.0 if impl == "default" else 32.0
        return dict(model=model, batch=32, impl=impl, rc=rc, train_args="", mfu=0.5, **stats)

    runs = [r("default", t, 11.0) for t in (600.0, 590.0, 610.0)]
    runs += [r("plain", t, 22.0) for t in (500.0, 480.0)] + [r("plain", 1.0, 1.0, rc=1)]
    runs += [r("default", 50.0, 60.0, model="1558M")]  # no plain run of its own: no ratio
    rows = {(x["model"], x["impl"]): x for x in throughput.summarise(runs)}
    assert rows["124M", "default"]["tok_per_s"] == 600.0
    assert rows["124M", "plain"]["tok_per_s"] == 490.0 and rows["124M", "plain"]["n"] == 2
    assert rows["124M", "plain"]["of"] == 3
    assert rows["124M", "default"]["vs_plain"] == pytest.approx(600 / 490)
    assert rows["124M", "default"]["peak_vs_plain"] == pytest.approx(0.5)
    assert rows["124M", "default"]["startup_vs_plain"] == pytest.approx(1.25)
    assert "vs_plain" not in rows["1558M", "default"]
    assert (
        throughput.train_args("124M", 32, "plain", 5, "d", "o")[-len(throughput.PLAIN) :]
        == throughput.PLAIN
    )


def test_throughput_time_budget_skips_a_run_that_would_end_past_it():
    """--time-budget: a run is not started when the last finished run of its model and impl
    (else the longest of its model), started now, would end past the budget; a model with no
    finished run yet only needs time left."""
    import time

    runs = [dict(model="1558M", impl="plain", wall_s=150.0), dict(model="124M", impl="plain",
            wall_s=56.0), dict(model="124M", impl="plain", wall_s=29.0)]  # fmt: skip
    budget = 500.0  # seconds
    now = time.time()
    assert not throughput.past_budget(runs, "124M", now - 460, budget, "plain")  # 460 + 29
    assert throughput.past_budget(runs, "124M", now - 460, budget, "default")  # 460 + 56 > 500
    assert not throughput.past_budget(runs, "124M", now - 440, budget, "default")  # 440 + 56
    assert throughput.past_budget(runs, "1558M", now - 400, budget, "plain")  # 400 + 150 > 500
    assert throughput.past_budget(runs, "1558M", now - 400, budget, "default")  # the longest
    assert not throughput.past_budget(runs, "350M", now - 499, budget)  # none yet: 499 < 500
    assert throughput.past_budget(runs, "350M", now - 501, budget)
    # a repeat of default and plain needs both: 400 + 56 (the longest, for default) + 29 > 450
    assert not throughput.past_budget(runs, "124M", now - 400, 450, "plain")
    assert throughput.past_budget(runs, "124M", now - 400, 450, ["default", "plain"])
    assert not throughput.past_budget(runs, "124M", now - 400, 490, ["default", "plain"])


def test_throughput_runs_a_repeat_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    """A repeat (every impl of one model:batch) that starts finishes: a gate whose tests ran long
    still gets its default and plain pair, never a default alone; the next repeat is skipped."""
    import sys
    import time

    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])

    def child(cli, **_):
        clock[0] += 60.0  # each run takes a minute
        return dict(rc=1, wall_s=60.0, error="not run")

    monkeypatch.setattr(throughput, "run_child", child)
    monkeypatch.setattr(throughput, "random_dataset", lambda *a: str(tmp_path))
    monkeypatch.setattr(throughput, "ROOT", str(tmp_path))
    argv = ["throughput", "--runs", "124M:32:4:1", "--impls", "default,plain", "--repeats", "3",
            "--time-budget", "100", "--out", str(tmp_path / "o")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    throughput.main()
    out = capsys.readouterr().out
    ran = [json.loads(line) for line in out.splitlines() if line.startswith('{"model"')]
    assert [(r["impl"], r["repeat"]) for r in ran] == [("default", 0), ("plain", 0)]
    assert "124M_b32_default_r1, 124M_b32_plain_r1, 124M_b32_default_r2" in out


def test_parity_reference_draws_random_windows_of_all_train_tokens(tmp_path):
    """RandomWindows: rows are T+1 consecutive tokens of the shards laid end to end, at offsets
    drawn with replacement over all of them; seeded per rank; its state continues the stream."""
    from data.shards import write_shard

    write_shard(tmp_path / "c_train_000001.bin", np.arange(300))  # token = position
    write_shard(tmp_path / "c_train_000002.bin", np.arange(300, 500))
    pattern = str(tmp_path / "c_train_*.bin")
    a = parity.RandomWindows(pattern, 8, 16, seed=3)
    firsts = []
    for _ in range(50):
        x, y = a.next_batch()
        assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
        assert torch.equal(x, x[:, :1] + torch.arange(16)) and torch.equal(y, x + 1)
        firsts += x[:, 0].tolist()
    assert 0 <= min(firsts) and max(firsts) <= 500 - 17
    assert min(firsts) < 300 - 16 < max(firsts)  # from both shards
    assert any(300 - 16 < f < 300 for f in firsts)  # and across their seam: one stream
    assert len(set(firsts)) < len(firsts)  # with replacement: 400 draws of 484 offsets repeat
    state = a.state_dict()
    expected = [a.next_batch()[0] for _ in range(3)]
    b = parity.RandomWindows(pattern, 8, 16, seed=3)
    b.load_state_dict(state)
    assert all(torch.equal(e, b.next_batch()[0]) for e in expected)
    other = parity.RandomWindows(pattern, 8, 16, rank=1, world_size=2, seed=3)
    assert not torch.equal(
        other.next_batch()[0], parity.RandomWindows(pattern, 8, 16, seed=3).next_batch()[0]
    )


def test_throughput_child_trains_and_skips_the_final_checkpoint(tiny_args, tmp_path):
    """throughput.py's child runs the real train.main with its final checkpoint replaced (it
    patches train.save_checkpoint: a move of that name must break this test, not a GPU call),
    and its log gives step_stats what they read."""
    out = tmp_path / "run"
    args = [*tiny_args, "--max_steps=4", "--eval_interval=0", "--sample_interval=0"]
    res = throughput.run_child([*args, f"--out_dir={out}"], timeout=300)
    assert res["rc"] == 0, res.get("error")
    assert res["peak_gib"] == 0.0  # no CUDA here
    assert not list(out.glob("ckpt_*.pt")) and (out / "no_checkpoint_in_benchmarks").exists()
    st = throughput.step_stats(str(out / "log.jsonl"), warmup=1)
    assert st["tok_per_s"] > 0 and st["loss_last"] < st["loss_first"]


def test_throughput_child_under_torchrun_reports_the_optimizer_state(tiny_args, tmp_path):
    """--torchrun (bench/shard_overhead.sh): the child under torchrun with one process, which
    --shard needs; the optimizer-state bytes that train.py measured come back with the run."""
    args = [*tiny_args, "--max_steps=2", "--eval_interval=0", "--sample_interval=0"]
    res = throughput.run_child([*args, "--shard='full'", f"--out_dir={tmp_path}"], torchrun=True)
    assert res["rc"] == 0, res.get("error")
    assert res["state_bytes"][0] > 8 * 40_000  # two fp32 moments of ~42K parameters


def test_shard_memory_takes_each_engines_own_split():
    """bench/shard_memory.py's per-rank counts (meta tensors, a fake group of 3 ranks): FSDP2
    splits every dim 0 in 3 (only wpe's 1024 rows leave a remainder: 342, 342, 340); ZeRO-1
    hands out whole tensors, so its largest rank is above N/3, by less than a block's share."""
    n = sum(p.numel() for p in shard_memory.meta_model("gpt2").parameters())
    zero, fsdp = shard_memory.largest_shares("gpt2", 3)
    assert fsdp == (n - 1024 * 768) // 3 + 342 * 768
    assert n / 3 <= zero < n / 3 + 768 * 768 * 4


def test_every_benchmark_is_listed_in_the_package_docstring():
    """bench/__init__.py names each module once, so a newcomer finds them all there."""
    modules = {p.stem for p in pathlib.Path(bench.__file__).parent.glob("*.py")} - {"__init__"}
    listed = re.findall(r"^    (\w+)  ", bench.__doc__, re.M)
    assert sorted(listed) == sorted(modules)


def test_write_json_makes_the_folder_and_skips_without_one(tmp_path):
    common.write_json(tmp_path / "a" / "b", "r.json", {"x": [1, 2]})
    assert json.loads((tmp_path / "a" / "b" / "r.json").read_text()) == {"x": [1, 2]}
    common.write_json(None, "r.json", {"x": 1})  # no --out: nothing written, no error


def test_for_benchmarks_skips_checkpoints_and_steps_the_profiler(tmp_path, monkeypatch):
    import types

    from gpt2_fused.training import runlog

    monkeypatch.setattr(runlog, "format_step", runlog.format_step)  # restored after the test
    fake_train, calls = types.SimpleNamespace(), []
    common.for_benchmarks(fake_train, on_step=lambda: calls.append(1))
    path = fake_train.save_checkpoint({"model": 1}, str(tmp_path), 5, 1)
    assert os.path.getsize(path) == 0
    rec = dict(step=3, loss=1.0, lr=1e-3, grad_norm=0.5, ms=10.0, tok_per_s=100.0)
    assert runlog.format_step(rec, 10).startswith("step      3/10") and calls == [1]


def test_step_timeline_counts_only_the_profiled_steps_on_the_gpu():
    """The summary's window is the profiler's step ranges as the GPU ran them: a kernel the step
    before queued, or one of the next step, is not counted (they made every ms a step ~1.2x
    too high). Busy time is the union of overlapping kernels; a gap is the idle time between."""
    from bench.step_timeline import summarise

    def ev(cat, name, ts, dur):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        ev("kernel", "before_window", 0, 50),
        ev("gpu_user_annotation", "ProfilerStep#1", 100, 100),
        ev("gpu_user_annotation", "ProfilerStep#2", 200, 100),
        ev("kernel", "nvjet_gemm", 100, 60),
        ev("kernel", "adamw_kernel", 140, 40),  # overlaps the GEMM: 20 µs of new busy time
        ev("cpu_op", "aten::copy_", 150, 5),
        ev("kernel", "cudnn_attn", 230, 70),  # 50 µs idle before it
        ev("kernel", "after_window", 300, 500),
    ]
    res = summarise(events, steps=2)
    assert res["span_ms_per_step"] == pytest.approx(0.2 / 2)  # 100 .. 300 µs
    assert res["busy_ms_per_step"] == pytest.approx((80 + 70) / 2 / 1e3)
    assert res["busy_fraction"] == pytest.approx(150 / 200)
    assert res["kernels_per_step"] == 1.5
    assert res["longest_gaps"][0] == {"us": 50.0, "after": "adamw_kernel", "before": "cudnn_attn",
                                      "host": "aten::copy_"}  # fmt: skip
    assert set(res["kind_ms_per_step"]) == {"cuBLAS GEMM", "AdamW", "cuDNN attention"}
    assert res["top_kernels"][0] == {"name": "cudnn_attn", "calls": 0.5, "ms": 0.035}
    assert [k["name"] for k in res["top_kernels"]] == ["cudnn_attn", "nvjet_gemm", "adamw_kernel"]
    unmarked = summarise([e for e in events if e["cat"] != "gpu_user_annotation"], 2)
    assert unmarked["span_ms_per_step"] == pytest.approx(0.8 / 2)  # no ranges: the whole trace


def test_peer_nanogpt_refuses_a_folder_without_model_py(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["peer_nanogpt", "--nanogpt", str(tmp_path)])
    with pytest.raises(SystemExit, match="no model.py in"):
        peer_nanogpt.main()


def test_peer_nanogpt_reports_the_childs_error_and_no_speed(tmp_path):
    """A checkout whose model.py fails: the run says why (its last lines) and has no tok/s."""
    (tmp_path / "model.py").write_text("raise ImportError('not the nanoGPT this expects')\n")
    r = peer_nanogpt.run(str(tmp_path), "124M", 8, steps=3, warmup=1, bias=False, timeout=120)
    assert r["rc"] != 0 and "tok_per_s" not in r
    assert "not the nanoGPT this expects" in r["error"]


def test_bench_muon_counts_newton_schulz_flops_and_prints_every_row(capsys):
    """Five steps of 2 m^2 n + m^3 multiply-adds on the wide side (m <= n), per matrix of the
    stack; on a CPU the check runs and the four rows print without timings."""
    assert bench_muon.ns_flops((768, 3072)) == 5 * 2 * (2 * 768**2 * 3072 + 768**3)
    assert bench_muon.ns_flops((3, 3072, 768)) == 3 * bench_muon.ns_flops((768, 3072))
    bench_muon.main(["--preset", "124M", "--layers", "1", "--reps", "1"])
    out = capsys.readouterr().out
    assert "0.127 TFLOP a step" in out and "compiled against the loop: 0.00%" in out
    for row in ("adamw", "muon", "ns compiled", "ns loop"):
        assert f"| {row} | nan |" in out
