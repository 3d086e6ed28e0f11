"""Config loading, overrides and their errors; the lr schedule; the pure helpers of train.py."""

import glob
import math
import os
import re

import pytest
import torch

import train
from gpt2_fused.training import checkpoint, compile_settings, memory, optim
from gpt2_fused.training.config import (
    ConfigError,
    TrainConfig,
    flat,
    grad_accum_steps,
    load_config,
    tokens_per_step,
)
from gpt2_fused.training.errors import run_main
from gpt2_fused.training.hardware import peak_flops
from gpt2_fused.training.optim import get_lr
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_arguments_give_the_dataclass_defaults():
    assert load_config([]) == TrainConfig()


def test_help_lists_every_setting(capsys):
    train.main(["--help"])
    text = capsys.readouterr().out
    assert "torchrun" in text and all(f"--{k}=" in text for k in flat(TrainConfig()))


def test_file_then_cli_overrides(tmp_path):
    cfg_file = tmp_path / "x.py"
    cfg_file.write_text(
        "import math\n"
        "_tokens = 2**20  # private helper: not a setting\n"
        "total_batch_size = 2**12\n"
        "max_steps = _tokens // total_batch_size\n"
        "learning_rate = 3  # an int is fine for a float field\n"
        "out_dir = 'runs/a'\n"
    )
    cfg = load_config([str(cfg_file), "--learning_rate=1e-4", "--device=cpu", "--resume"])
    assert cfg.total_batch_size == 4096 and cfg.max_steps == 256
    assert cfg.learning_rate == 1e-4 and isinstance(cfg.learning_rate, float)
    assert cfg.out_dir == "runs/a" and cfg.device == "cpu" and cfg.resume is True
    assert load_config([str(cfg_file)]).learning_rate == 3.0
    assert load_config(["--compile=None"]).compile is None
    assert load_config(["--compile=False"]).compile is False
    assert load_config(["--out_dir=2024"]).out_dir == "2024"  # str fields take the text as is
    assert load_config(["--wandb_run_name='a b'"]).wandb_run_name == "a b"


def test_preset_sets_shape_and_explicit_keys_win(tmp_path):
    cfg = load_config(["--model=gpt2-medium"])
    assert cfg.model == GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024)
    cfg = load_config(["--model=124M", "--n_layer=2", "--block_size=64", "--max_steps=5"])
    assert cfg.model == GPTConfig(n_layer=2, n_head=12, n_embd=768, block_size=64)
    assert cfg.max_steps == 5
    # in a config file too, in any order: the preset first, then the fields given
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text('softcap = 30\nmodel = "gpt2-xl"\n')
    cfg = load_config([str(cfg_file), "--n_head=20"])
    assert cfg.model == GPTConfig(n_layer=48, n_head=20, n_embd=1600, softcap=30.0)


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--n_layr=3"], "n_layr"),
        (["--n_layer=2.5"], "n_layer"),
        (["--n_layer=True"], "n_layer"),  # a bool is not an int here
        (["--n_layer=abc"], "n_layer"),
        (["--learning_rate='fast'"], "learning_rate"),
        (["--resume=1"], "resume"),
        (["--n_layer"], "n_layer"),  # a bare flag only for bools
        (["--compile=maybe"], "compile"),
        (["--batch_size=0"], "batch_size"),
        (["--max_steps=-1"], "max_steps"),
        (["--final_lr_frac=2.0"], "final_lr_frac"),
        (["--dtype=fp16"], "dtype"),
        (["--fp8=bf16"], "fp8"),
        (["--shard=zero"], "shard"),
        (["--fp8=fused", "--shard=full"], "shard"),
        (["--compile_mode=fastest"], "compile_mode"),
        (["--activation_memory_budget=0.0"], "activation_memory_budget"),
        (["--activation_memory_budget=1.5"], "activation_memory_budget"),
        (["--activation_memory_budget=0.9", "--dropout=0.1"], "dropout"),
        (["--buffer_reuse=some"], "buffer_reuse"),
        (["--layernorm_partial_rows=-2"], "layernorm_partial_rows"),
        (["--ddp_compile=both"], "ddp_compile"),
        (["--grad_sync=once"], "grad_sync"),
        (["--grad_sync=step", "--shard=full"], "shard='full'"),
        (["--grad_sync=step", "--ddp_compile=ddp"], "ddp_compile='ddp'"),
        (["--model=gpt9"], "model"),
        (["--seed=-1"], "seed"),
        (["--z_loss=-1e-4"], "z_loss"),
        (["--z_loss=1e999"], "z_loss"),  # inf
        (["--shuffle=0"], "shuffle"),
    ],
)
def test_bad_cli_arguments_name_the_key(argv, key):
    with pytest.raises(ConfigError, match=key):
        load_config(argv)


def test_softcap_is_a_model_setting_and_z_loss_a_training_one():
    """softcap changes what the model computes: it goes to GPTConfig and is saved and checked on
    resume; z_loss only changes the training objective."""
    cfg = load_config(["--softcap=30", "--z_loss=1e-4"])
    assert (cfg.model.softcap, cfg.z_loss) == (30.0, 1e-4) and isinstance(cfg.model.softcap, float)
    assert not hasattr(cfg, "softcap") and not hasattr(cfg.model, "z_loss")
    assert (TrainConfig().model.softcap, TrainConfig().z_loss) == (0.0, 0.0)  # both off


def test_bad_config_files(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("n_layers = 6\n")
    with pytest.raises(ConfigError, match="'n_layers' in .*; did you mean n_layer"):
        load_config([str(bad)])
    bad.write_text("max_steps = 10e9 / 524288\n")  # float for an int field
    with pytest.raises(ConfigError, match="max_steps"):
        load_config([str(bad)])
    bad.write_text("max_steps = 10\nlearning_rate = = 3e-4\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}:2: invalid syntax: learning"):
        load_config([str(bad)])
    bad.write_text("# the text of a setting needs quotes\nmodel = gpt2\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}:2: name 'gpt2' is not defined"):
        load_config([str(bad)])
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: train.main([str(bad)]), train.USER_ERRORS)  # one line on the command line
    assert exit_.value.code == 2  # a usage error (errors.py)
    assert re.fullmatch(r"config error: .*bad.py:2: name 'gpt2'[^\n]*\n", capsys.readouterr().err)
    with pytest.raises(ConfigError, match="not found"):
        load_config([str(tmp_path / "missing.py")])
    with pytest.raises(ConfigError, match="unexpected argument"):
        load_config(["n_layer=3"])


def test_grad_accum_steps():
    assert grad_accum_steps(524288, 64, 1024, 8) == 1
    assert grad_accum_steps(524288, 16, 1024, 1) == 32
    with pytest.raises(ConfigError, match=r"total_batch_size=1000 .* 4 \* 32 \* 2 = 256") as e:
        grad_accum_steps(1000, 4, 32, 2)
    assert "pass total_batch_size=768 or total_batch_size=1024" in str(e.value)
    assert grad_accum_steps(0, 4, 32, 2) == 1  # the default: one micro-batch a process
    with pytest.raises(ConfigError) as e:  # 2 processes with the one-process total
        grad_accum_steps(128, 4, 32, 2)
    assert "total_batch_size=256 or batch_size=2" in str(e.value) and "\n" not in str(e.value)


def test_tokens_per_step_is_the_micro_batches_of_every_process():
    cfg = load_config(["--batch_size=4", "--block_size=32", "--total_batch_size=1024"])
    assert tokens_per_step(cfg, 2) == (1024, 4)  # 4 * 32 * 2 tokens a micro-step, 4 of them
    one = load_config(["--batch_size=4", "--block_size=32"])  # total_batch_size 0
    assert tokens_per_step(one, 2) == (256, 1)
    with pytest.raises(ConfigError, match="total_batch_size=1024 must be a multiple"):
        tokens_per_step(cfg, 3)


def test_errors_stop_main_before_training(tmp_path):
    with pytest.raises(ConfigError, match="total_batch_size"):
        train.main(["--device=cpu", "--total_batch_size=1000", f"--out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="n_head"):
        train.main(["--device=cpu", "--n_head=3", f"--out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="device"):
        train.main(["--device=tpu", f"--out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="model settings: softcap must be a finite number >= 0"):
        train.main(["--device=cpu", "--softcap=-1", f"--out_dir={tmp_path}"])
    assert not os.listdir(tmp_path)


def test_lr_schedule():
    cfg = TrainConfig(learning_rate=1.0, final_lr_frac=0.1, warmup_steps=10, max_steps=110)
    assert get_lr(0, cfg) == pytest.approx(0.1)  # linear warmup from lr/warmup
    assert get_lr(9, cfg) == pytest.approx(1.0)
    assert get_lr(10, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    assert get_lr(60, cfg) == pytest.approx(0.55)  # halfway: mean of peak and floor
    assert get_lr(110, cfg) == pytest.approx(0.1)
    lrs = [get_lr(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    expected = 0.1 + 0.45 * (1 + math.cos(math.pi * 0.25))
    assert get_lr(35, cfg) == pytest.approx(expected)


# torch.cuda.get_device_name() as these GPUs report it -> dense (bf16, fp16, fp32) TFLOP/s from
# their spec sheets (GeForce: FP32 accumulate; fp32: TF32 tensor cores where there are any)
PEAKS = {
    "NVIDIA GeForce RTX 4090": (165.2, 165.2, 82.6),
    "NVIDIA GeForce RTX 3090": (71, 71, 35.6),
    "NVIDIA GeForce RTX 5090": (209.5, 209.5, 104.8),
    "Tesla T4": (None, 65, 8.1),
    "Tesla V100-SXM2-16GB": (None, 125, 15.7),
    "Tesla V100-PCIE-32GB": (None, 112, 14),
    "NVIDIA A10G": (70, 70, 35),
    "NVIDIA A10": (125, 125, 62.5),
    "NVIDIA A100-SXM4-40GB": (312, 312, 156),
    "NVIDIA A100 80GB PCIe": (312, 312, 156),
    "NVIDIA H100 80GB HBM3": (989, 989, 495),
    "NVIDIA H100 PCIe": (756, 756, 378),
    "NVIDIA H100 NVL": (835, 835, 418),
    "NVIDIA H200": (989, 989, 495),
    "NVIDIA GH200 480GB": (989, 989, 495),
    "NVIDIA L4": (121, 121, 60),
    "NVIDIA L40S": (362, 362, 183),
    "NVIDIA L40": (181, 181, 90.5),
    "NVIDIA B200": (2250, 2250, 1125),
}


@pytest.mark.parametrize("name", sorted(PEAKS))
def test_peak_flops_by_gpu_and_dtype(name):
    got = [peak_flops(name, dt) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    assert got == [None if t is None else pytest.approx(t * 1e12) for t in PEAKS[name]]


@pytest.mark.parametrize(
    "name",
    ["cpu", "Some Future GPU", "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 4090 Laptop GPU",
     "NVIDIA GeForce RTX 3090 Ti", "NVIDIA H800", "NVIDIA RTX A6000", "", None],
)  # fmt: skip
def test_peak_flops_unknown_gpu_gives_no_mfu(name):
    """A name that is not in the table, or a variant of one (another chip or clock), has no
    peak: the step lines then show no MFU rather than a wrong one."""
    assert all(peak_flops(name, dt) is None for dt in (torch.bfloat16, torch.float32))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))))
def test_shipped_configs_load_and_divide(path):
    cfg = load_config([path])
    assert cfg.batch_size == "auto"  # picked to fit the GPU (gpt2_fused/training/memory.py)
    for world_size in (1, 8):  # the ladder's top rung allowed, and each divides the step
        T = cfg.model.block_size
        rungs = memory.allowed_rungs(cfg.total_batch_size, T, world_size)
        assert rungs[0] == min(64, cfg.total_batch_size // (T * world_size))
        for b in rungs:
            grad_accum_steps(cfg.total_batch_size, b, T, world_size)
    assert cfg.warmup_steps < cfg.max_steps


def test_recipes_match_llmc():
    def load(name):
        return load_config([os.path.join(REPO, "configs", name)])

    c = load("gpt2_124m_fineweb.py")
    assert (c.model.n_layer, c.model.n_embd) == (12, 768)
    assert (c.total_batch_size, c.learning_rate) == (524288, 6e-4)
    assert (c.warmup_steps, c.weight_decay, c.final_lr_frac) == (700, 0.1, 0.0)
    assert 9.8e9 < c.max_steps * c.total_batch_size < 10.1e9
    c = load("gpt2_350m_fineweb.py")
    assert (c.model.n_layer, c.model.n_embd, c.learning_rate) == (24, 1024, 3e-4)
    assert round(c.max_steps * c.total_batch_size / 1e9, 1) == 31.5
    c = load("gpt2_774m_fineweb.py")
    assert (c.model.n_layer, c.model.n_embd, c.learning_rate) == (36, 1280, 2.5e-4)
    assert round(c.max_steps * c.total_batch_size / 1e9) == 150
    c = load("gpt2_1558m_fineweb_edu.py")
    assert (c.model.n_layer, c.model.n_embd, c.total_batch_size) == (48, 1600, 1048576)
    assert (c.learning_rate, c.final_lr_frac) == (6e-4, 0.1)
    assert round(c.max_steps * c.total_batch_size / 1e9, 1) == 33.6  # 32000 x 2**20


def test_checkpoint_files_are_atomic_and_pruned(tmp_path):
    for step in (10, 20, 30, 40):
        obj = {"step": step, "w": torch.full((3,), float(step))}
        checkpoint.save_checkpoint(obj, tmp_path, step, 2)
    names = sorted(os.listdir(tmp_path))
    assert names == ["ckpt_0000030.pt", "ckpt_0000040.pt"]  # no .tmp left, oldest pruned
    latest = checkpoint.list_checkpoints(tmp_path)[-1]
    ckpt = checkpoint.load_checkpoint(latest)
    assert ckpt["step"] == 40 and torch.equal(ckpt["w"], torch.full((3,), 40.0))


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("grad_size, max_norm", [(10.0, 1.0), (1e-4, 1.0), (10.0, math.inf)])
def test_clipped_step_matches_clip_then_adamw(device, fused, grad_size, max_norm):
    """optim.clipped_step (the clip folded into the fused AdamW's grad_scale, or the plain
    path) against a hand clip (global L2 norm, factor min(max_norm / (norm + 1e-6), 1)) and a
    single-tensor AdamW, over 3 steps: clipping on (grads far above max_norm), off (far
    below) and disabled (inf); clipped_step's returned norm is the one before clipping."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(33, 17), (17,), (5, 3, 2)]
    start = [torch.randn(s, generator=gen).to(device) for s in shapes]
    steps = [[torch.randn(s, generator=gen) * grad_size for s in shapes] for _ in range(3)]
    grads = [[g.to(device) for g in step] for step in steps]

    def adamw(params, **kw):
        groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}]
        return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, **kw)

    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt, ref_opt = adamw(ours, fused=fused), adamw(ref, foreach=False)
    for step_grads in grads:
        for p, q, g in zip(ours, ref, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        norm = optim.clipped_step(opt, ours, max_norm)
        ref_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in step_grads]))
        coef = min(max_norm / (ref_norm.item() + 1e-6), 1.0)
        for q in ref:
            q.grad.mul_(coef)
        ref_opt.step()
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)  # clipped grads
            torch.testing.assert_close(p.data, q.data, rtol=1e-6, atol=1e-7)
    moved = max((p.data - t).abs().max().item() for p, t in zip(ours, start, strict=True))
    assert moved > 1e-3  # the steps did something


def test_auto_compile_mode_takes_cuda_graphs_for_small_micro_batches_on_a_gpu():
    """ "auto": CUDA graphs on a GPU whose micro-batch leaves the host pacing the step (124M at
    8 and 16, not at 32 or 1558M at 16); the default mode where DDP's buckets or FSDP2 sum the
    grads under torchrun (bucketed), and on a CPU; a mode the user names is kept."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def per_layer(preset, batch):  # as train.py computes it
        with torch.device("meta"):  # shapes only
            model = GPT(GPTConfig.from_preset(preset))
        return model.flops_per_token() * batch * 1024 / model.config.n_layer

    small, large = per_layer("gpt2", 16), per_layer("gpt2", 32)
    assert (
        compile_settings.pick_mode("auto", cuda, False, per_layer("gpt2", 8)) == "reduce-overhead"
    )
    assert compile_settings.pick_mode("auto", cuda, False, small) == "reduce-overhead"
    assert compile_settings.pick_mode("auto", cuda, False, large) == "default"
    assert compile_settings.pick_mode("auto", cuda, False, per_layer("gpt2-xl", 16)) == "default"
    assert compile_settings.pick_mode("auto", cuda, True, small) == "default"
    assert compile_settings.pick_mode("auto", cpu, False, small) == "default"
    assert compile_settings.pick_mode("max-autotune", cuda, True, small) == "max-autotune"
    assert TrainConfig().compile_mode == "auto"
