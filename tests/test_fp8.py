"""FP8 GEMMs as a model setting (GPTConfig.fp8, --fp8) and gpt2_fused/training/fp8.py: a torchao
recipe builds exactly the blocks' Linears as Float8Linear and turns the fast paths that bypass them
off, check() refuses a run that cannot use FP8 in one line, FSDP2 gathers tensorwise weights in
float8, and checkpoints of FP8 runs hold plain tensors that load into plain and FP8 models alike.
On CPU torchao converts, and even runs the FP8 GEMMs (torch 2.11, 2.13); on a GPU with FP8 tensor
cores, 20 training steps with --fp8 follow the bf16 run's losses."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

torchao = pytest.importorskip("torchao", reason="--fp8 needs torchao: pip install torchao")

from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402  (not public; types only)

import model as model_module  # noqa: E402
import train  # noqa: E402
from bench.fp8_stress import ARGS as STRESS_ARGS  # noqa: E402
from conftest import read_log  # noqa: E402
from gpt2_fused.kernels.launch import FORCE_CAPABILITY  # noqa: E402
from gpt2_fused.training import data_parallel, fp8, model_io  # noqa: E402
from gpt2_fused.training.config import TrainConfig  # noqa: E402
from gpt2_fused.training.distributed import Processes  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ["tensorwise", "rowwise"]
BLOCK_LINEARS = [f"transformer.h.{i}.{n}" for i in range(2) for n in fp8.BLOCK_LINEARS]


def tiny_model(seed=0, **kw):
    """The 2-layer, 64-wide GPT of the task (2 heads, T 32); the torch loss, which runs on CPU
    without the Triton interpreter."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, loss_impl="torch", **kw))


def batch(seed=1, vocab=50257):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (4, 33), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("recipe", RECIPES)
def test_torchao_recipes_build_exactly_the_blocks_linears_as_float8(recipe):
    """GPTConfig(fp8=recipe): 4 * n_layer Float8Linears with the recipe's config; every other
    module of the plain model's type; lm_head an nn.Linear tied to wte; the plain model's state
    dict keys and, from the same seed, its initial weights."""
    plain, model = tiny_model(), tiny_model(fp8=recipe)
    assert [n for n, m in model.named_modules() if isinstance(m, Float8Linear)] == BLOCK_LINEARS
    kinds = {name: type(m) for name, m in plain.named_modules()}
    for name, m in model.named_modules():
        if name in BLOCK_LINEARS:
            assert m.config == Float8LinearConfig.from_recipe_name(recipe)
            assert not m.config.enable_fsdp_float8_all_gather
        else:
            assert type(m) is kinds[name], name
    assert type(model.lm_head) is nn.Linear and type(model.transformer.wte) is nn.Embedding
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    _assert_same_weights(model, plain)


@pytest.mark.parametrize("recipe", ["off", "fused"])
def test_other_recipes_build_no_float8_linear(recipe):
    assert not any(isinstance(m, Float8Linear) for m in tiny_model(fp8=recipe).modules())


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_all_gather_only_for_tensorwise_under_fsdp2(recipe):
    """gather_in_float8 (FSDP2's, before fully_shard): tensorwise's weights become torchao's
    float8 all-gather wrappers of the same values; rowwise has none (torchao's is tensorwise
    only) and keeps plain weights."""
    model = tiny_model(fp8=recipe)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fp8.gather_in_float8(model)
    gather = recipe == "tensorwise"
    for name in BLOCK_LINEARS:
        m = model.get_submodule(name)
        assert type(m) is Float8Linear and m.config.enable_fsdp_float8_all_gather == gather
        assert (type(m.weight.data) is not torch.Tensor) == gather, name
    assert type(model.lm_head.weight.data) is torch.Tensor
    for n, p in model.named_parameters():
        torch.testing.assert_close(fp8._plain(p.detach()), before[n], rtol=0, atol=0, msg=n)


def test_blocks_pick_their_paths_from_the_recipe_and_the_forward_runs_the_float8_linears(
    monkeypatch,
):
    """On a Hopper GPU (faked) the plain model takes the fast MLP and attention paths, which run
    their GEMMs from the raw weights; a torchao recipe's blocks take the torch path, whose
    forward calls every Float8Linear once; fused keeps them (for decoding) beside its FP8 state."""
    with monkeypatch.context() as m:
        m.setenv(FORCE_CAPABILITY, "9.0")
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(model_module.cublaslt, "available", lambda: True)
        m.setattr(model_module.attention, "available", lambda: True)
        for recipe, fast in [("off", True), ("tensorwise", False), ("rowwise", False),
                             ("fused", True)]:  # fmt: skip
            for block in tiny_model(fp8=recipe).transformer.h:
                assert block.mlp.use_cublaslt is fast and block.attn.use_fast is fast, recipe
                assert (block.attn.fp8_state is not None) == (recipe == "fused")
                assert (block.mlp.fp8_state is not None) == (recipe == "fused")
    model = tiny_model(fp8="tensorwise")
    calls = []
    for name in BLOCK_LINEARS:
        model.get_submodule(name).register_forward_hook(lambda m, i, o, n=name: calls.append(n))
    model(*batch()).backward()
    assert calls == BLOCK_LINEARS  # in the order of the forward
    assert all(model.get_submodule(n).weight.grad is not None for n in BLOCK_LINEARS)


def test_gptconfig_refuses_what_the_fp8_gemms_cannot_take():
    with pytest.raises(ValueError, match="n_embd divisible by 16, got 72"):
        GPTConfig(n_layer=1, n_head=2, n_embd=72, block_size=32, fp8="tensorwise")
    with pytest.raises(ValueError, match="fp8 must be one of"):
        GPTConfig(fp8="bf16")
    GPTConfig(n_layer=1, n_head=2, n_embd=72, block_size=32)  # "off": any width


def _cuda_gpu(monkeypatch, name, cc):
    """Make torch report a CUDA GPU `name` of compute capability `cc` (this machine has none)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)


@pytest.mark.parametrize(
    "recipe, device, setup, says",
    [
        ("tensorwise", "cpu", None, "needs a CUDA GPU with FP8 tensor cores"),
        ("rowwise", "cpu", None, "this run is on cpu: pass --fp8=off"),
        ("tensorwise", "cpu", "no torchao", "needs torchao's float8 training: pip install torchao"),
        ("tensorwise", "cuda", "old torchao", "torchao 0.16.0 is older than 0.17"),
        ("tensorwise", "cuda", "old torch", "needs torch >= 2.11, this is torch 2.10.0"),
        ("tensorwise", "cuda", "no api", "lacks the float8 training API used here"),
        ("tensorwise", "cuda", "A100", "NVIDIA A100-SXM4-80GB (compute capability 8.0) has no"),
        ("rowwise", "cuda", "no kernel", "FP8 GEMMs fail on NVIDIA H200 with torch"),
    ],
)
def test_check_refuses_in_one_line(monkeypatch, recipe, device, setup, says):
    if setup == "no torchao":
        monkeypatch.setitem(sys.modules, "torchao", None)  # import fails
    elif setup == "old torchao":
        monkeypatch.setattr(torchao, "__version__", "0.16.0")
    elif setup == "old torch":
        monkeypatch.setattr(torch, "__version__", "2.10.0")
    elif setup == "no api":
        monkeypatch.delattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp")
    elif setup == "A100":
        _cuda_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    elif setup == "no kernel":
        _cuda_gpu(monkeypatch, "NVIDIA H200", (9, 0))

        def fails(recipe, device):
            raise RuntimeError("rowwise scaling is not supported here\n(the rest of torch's text)")

        monkeypatch.setattr(fp8, "_tiny_step", fails)
    with pytest.raises(ValueError) as e:
        fp8.check(recipe, device)
    assert says in str(e.value) and "\n" not in str(e.value)
    if setup == "no kernel":
        assert "(rowwise scaling is not supported here)" in str(e.value)


def test_check_passes_off_without_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    assert fp8.check("off", "cpu") == []  # nothing to report either


def test_check_passes_on_an_fp8_gpu_whatever_the_sharding(monkeypatch):
    """A Hopper GPU whose tiny FP8 step runs: every recipe passes, under any sharding mode (the
    check does not depend on it: rowwise + FSDP2 gathers the fp32 weights); check() never asks
    torch for the GPU beyond what _cuda_gpu fakes."""
    _cuda_gpu(monkeypatch, "NVIDIA H200", (9, 0))
    seen = []
    monkeypatch.setattr(fp8, "_tiny_step", lambda recipe, device: seen.append(device))
    for recipe in RECIPES:
        for device in ("cuda", torch.device("cuda")):  # train.py passes the string
            notes = fp8.check(recipe, device)  # the start-up report's line
            assert notes == [f"fp8 {recipe}: the blocks' Linears on FP8 GEMMs (torchao), lm_head "
                             "bf16"]  # fmt: skip
    assert seen and all(d == torch.device("cuda") for d in seen)


@pytest.mark.parametrize("right", [True, False])
def test_check_fused_refuses_a_ptxas_that_miscompiles_the_transposes(monkeypatch, right):
    """--fp8=fused runs its tiny step, then checks the transposed FP8 copies byte for byte
    (Triton 3.6's bundled ptxas gets them wrong on an H200): a one-line way out when wrong; when
    right, a note where act_fp8 makes them by passes of their own."""
    _cuda_gpu(monkeypatch, "NVIDIA H200", (9, 0))
    monkeypatch.setattr(fp8, "_tiny_fused_step", lambda device: None)
    monkeypatch.setattr(fp8, "_transposes_right", lambda device: right)
    if right:
        for split in (False, True):
            monkeypatch.setattr(fp8, "transposes_split", lambda device, s=split: s)
            notes = fp8.check("fused", "cuda")
            assert "(our kernels' casts)" in notes[0] and len(notes) == 1 + split, notes
        assert "TRITON_PTXAS_PATH saves those passes" in notes[1]
        return
    with pytest.raises(ValueError) as e:
        fp8.check("fused", "cuda")
    assert "TRITON_PTXAS_PATH" in str(e.value) and "\n" not in str(e.value)


def test_transposes_split_where_the_kernels_copy_is_wrong(monkeypatch):
    """train.py's note: act_fp8's transposed copies by passes of their own on this GPU."""
    from gpt2_fused.kernels import act_fp8

    for right in (True, False):
        monkeypatch.setattr(act_fp8, "kernel_transposes_right", lambda device, how, r=right: r)
        monkeypatch.setattr(act_fp8, "transpose_way", lambda device: 2)
        assert fp8.transposes_split("cuda") is not right


def _saved_and_loaded(state, tmp_path):
    """state through torch.save and torch.load(weights_only=True), as the trainer writes and
    sample.py reads a checkpoint."""
    torch.save({"model": state}, tmp_path / "ckpt.pt")
    return torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("recipe", [*RECIPES, "fused"])
def test_checkpoints_load_across_fp8_and_plain_models(recipe, tmp_path):
    """An FP8 model's state dict holds plain tensors under the plain model's keys: it loads
    (strict) into a plain model, GPT.from_state_dict (sample.py, eval; with the recipe too) and
    an FP8 model (resume); a plain model's loads into an FP8 model. The values arrive unchanged
    each way."""
    model = tiny_model(seed=0, fp8=recipe)
    state = _saved_and_loaded(model.state_dict(), tmp_path)
    assert all(type(t) is torch.Tensor for t in state.values())
    plain = tiny_model(seed=1)
    plain.load_state_dict(state)
    _assert_same_weights(plain, model)
    off = dataclasses.replace(model.config, fp8="off")
    for config in (off, model.config):
        _assert_same_weights(GPT.from_state_dict(config, state), model)
    resumed = tiny_model(seed=2, fp8=recipe)
    resumed.load_state_dict(state)
    _assert_same_weights(resumed, model)
    other = tiny_model(seed=3)
    resumed.load_state_dict(_saved_and_loaded(other.state_dict(), tmp_path))
    _assert_same_weights(resumed, other)
    swapped = recipe != "fused"  # torchao's recipes
    assert all(isinstance(resumed.get_submodule(n), Float8Linear) == swapped for n in BLOCK_LINEARS)


@pytest.mark.parametrize("recipe", [*RECIPES, "fused"])
def test_a_checkpoint_of_an_fp8_run_loads_as_a_plain_model(recipe, tmp_path):
    """sample.py's and eval's loader (model_io.from_checkpoint) reads a checkpoint whose
    model_config says fp8=<recipe> as a plain model (fp8 "off", on any device) with its
    weights."""
    model = tiny_model(fp8=recipe)
    ckpt = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}
    torch.save(ckpt, tmp_path / "ckpt_0000001.pt")
    loaded, _ = model_io.from_checkpoint(tmp_path)
    assert loaded.config.fp8 == "off"  # as the fast paths, today's default
    assert not any(isinstance(m, Float8Linear) for m in loaded.modules())
    assert all(b.attn.fp8_state is None for b in loaded.transformer.h)
    _assert_same_weights(loaded, model)


def test_fsdp2_float8_all_gather_trains_like_fp8_alone_and_saves_plain_tensors(tmp_path):
    """One gloo rank: tensorwise under FSDP2 (data_parallel.FSDP2 turns torchao's float8 all-gather
    on before fully_shard) trains 3 steps to the losses of the unsharded FP8 model: the same scales
    (amax of the whole weight), precomputed after each optimizer step (FSDP2.step) from the updated
    weights. Bit for bit on torch 2.13; torch 2.11's CPU GEMM sums the weight's other layout in
    another order (4e-5 relative at the first step), and FP8's roundings can carry that on: 1e-3
    relative allowed. FSDP2's own full state dict keeps torchao's wrapper at world size 1;
    full_state unwraps it into a checkpoint that loads into a plain model and back into the sharded
    FP8 one."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    procs = Processes(ddp=True, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

    def run(shard):
        mode = data_parallel.mode(TrainConfig(shard=shard, adamw_impl="torch"), procs)
        model = tiny_model(vocab_size=512, padded_vocab_size=512, fp8="tensorwise")
        mode.shard_model(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            loss = model(*batch(step, vocab=512))
            loss.backward()
            mode.step(optimizer, model, 1.0)
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return model, optimizer, losses, mode

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        _, _, want, _ = run("none")
        model, optimizer, got, full = run("full")
        assert got == pytest.approx(want, rel=1e-3, abs=0)
        fp8_max = torch.finfo(torch.float8_e4m3fn).max
        for name in BLOCK_LINEARS:  # the next forward's scale, of the updated weight
            w = model.get_submodule(name).weight._local_tensor
            want_scale = (fp8_max / w._tensor.abs().max().double()).float()
            assert w._precomputed_scale == want_scale, name
        own = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        assert any(type(t) is not torch.Tensor for t in own.values())  # why full_state unwraps
        state, opt_state = full.full_state(model, optimizer, True)
        assert all(type(t) is torch.Tensor for t in state.values())
        ckpt = {"model": state, "optimizer": opt_state}
        torch.save(ckpt, tmp_path / "ckpt.pt")
        ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        assert all(type(t) is torch.Tensor for t in ckpt["model"].values())
        plain = tiny_model(seed=1, vocab_size=512, padded_vocab_size=512)
        plain.load_state_dict(ckpt["model"])
        for name, t in own.items():
            torch.testing.assert_close(plain.state_dict()[name], fp8._plain(t), rtol=0, atol=0)
        full.load_state(model, optimizer, ckpt)
        assert model(*batch(5, vocab=512)).isfinite()
    finally:
        dist.destroy_process_group()


# GPU: through train.main, as users run it (compiled, bf16 autocast, the fused loss)


def _fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


# nats, at each of 20 steps from the same init and batches. FP8 rounds each GEMM operand to 3
# mantissa bits (e4m3; bf16 keeps 7): 2^-4 relative per element, averaged over the GEMMs' sums of
# 768..3072 products, and a small difference upstream flips roundings downstream, so the curves
# wander apart by a few hundredths: at most 0.031 in such runs on an H200, where bf16 and fp32
# matmuls stay within 1e-3 (the 1558M run agreed with bf16 to 4 digits). 0.1 leaves room
# for that wander and is still far below the 2+ nats the loss falls over these steps: a wrong
# conversion (a Linear left out, a fast path left on, wrong scales) breaks it. The learning rate
# (3e-4) keeps bf16 itself stable: at 1e-3 a bf16 run spiked by 7 nats at one step and the plain
# path sat 0.93 nats from it (bench/RESULTS.md#fp8-fused-end-to-end, bench/fp8_stress.py).
LOSS_TOL = 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
@pytest.mark.parametrize("recipe", [*RECIPES, "fused"])
def test_gpu_fp8_training_follows_bf16_over_20_steps(recipe, tmp_path, capsys):
    """20 steps on the embedded data at n_embd 768, 4 layers, B 8 x T 256 (the model's default
    fast paths, compiled): --fp8=<recipe> and --fp8=off from the same seed log losses within
    LOSS_TOL of each other at every step, and both fall."""
    args = STRESS_ARGS  # bench/fp8_stress.py runs the same over seeds
    train.main(args + [f"--out_dir={tmp_path}/bf16", "--fp8=off"])
    train.main(args + [f"--out_dir={tmp_path}/fp8", f"--fp8={recipe}"])
    capsys.readouterr()
    ref, _ = read_log(tmp_path / "bf16")
    got, _ = read_log(tmp_path / "fp8")
    assert sorted(got) == sorted(ref) == list(range(20))
    gaps = {step: abs(got[step] - ref[step]) for step in ref}
    assert max(gaps.values()) <= LOSS_TOL, gaps
    assert got[19] < got[0] - 1.0 and ref[19] < ref[0] - 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
@pytest.mark.parametrize("recipe", [*RECIPES, "fused"])
def test_gpu_check_passes_and_a_converted_block_matches_bf16(recipe):
    """check() passes on this GPU; a 768-wide model with the recipe (built on the CPU and moved,
    its FP8 state along) has bf16's loss within FP8's rounding, and its fp32 master weights get
    gradients (recipe "fused": the MLPs' only)."""
    linears = [n for n in BLOCK_LINEARS if recipe != "fused" or ".mlp." in n]
    assert fp8.check(recipe, "cuda")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=12, n_embd=768, block_size=256)
    ref = GPT(cfg).cuda()
    model = GPT(dataclasses.replace(cfg, fp8=recipe)).cuda()
    model.load_state_dict(ref.state_dict())
    x = torch.randint(0, cfg.vocab_size, (8, 257), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, loss = ref(x[:, :-1], x[:, 1:]), model(x[:, :-1], x[:, 1:])
    loss.backward()
    assert abs(loss.item() - want.item()) <= LOSS_TOL
    for name in linears:
        w = model.get_submodule(name).weight
        assert w.dtype == torch.float32 and w.grad is not None and w.grad.isfinite().all()


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
def test_gpu_fsdp2_float8_all_gather_follows_unsharded_fp8(tmp_path):
    """--shard=full --fp8=tensorwise under torchrun, one GPU (the float8 all-gather, its scales
    precomputed after each step) logs the unsharded --fp8=tensorwise run's losses within
    LOSS_TOL, and writes a checkpoint of plain tensors that loads into a plain model."""
    args = [
        "--n_layer=2",
        "--n_head=12",
        "--n_embd=768",
        "--block_size=256",
        "--batch_size=8",
        "--total_batch_size=2048",
        "--max_steps=10",
        "--warmup_steps=5",
        "--eval_interval=0",
        "--sample_interval=0",
        "--device=cuda",
        "--dtype=auto",
        "--adamw_impl=torch",
        "--fp8=tensorwise",
    ]
    train.main(args + [f"--out_dir={tmp_path}/plain"])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd = [*launcher, "train.py", *args, "--shard=full", f"--out_dir={tmp_path}/fsdp"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    ref, _ = read_log(tmp_path / "plain")
    got, _ = read_log(tmp_path / "fsdp")
    assert sorted(got) == sorted(ref) == list(range(10))
    assert max(abs(got[s] - ref[s]) for s in ref) <= LOSS_TOL
    model, ckpt = model_io.from_checkpoint(tmp_path / "fsdp")
    assert all(type(t) is torch.Tensor for t in ckpt["model"].values())
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_check_fused_needs_no_torchao_but_a_gpu(monkeypatch):
    """--fp8=fused runs our kernels, not torchao's: on a CPU it stops in one line."""
    monkeypatch.setitem(sys.modules, "torchao", None)  # not importable: never asked for
    with pytest.raises(ValueError, match="fp8='fused' needs a CUDA GPU"):
        fp8.check("fused", "cpu")
