"""gpt2_fused/training/compile_cache.py: torch.compile's disk cache, one folder per version of the
custom ops' sources (a stale cached backward would otherwise survive an edit)."""

import os
import re
import shutil

import train
from gpt2_fused.training.compile_cache import (
    ENV,
    OP_SOURCES,
    PREFIX,
    ROOT,
    ops_hash,
    use_keyed_cache,
)


def test_the_hash_follows_the_op_sources_only(tmp_path):
    for folder in OP_SOURCES:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "model.py", tmp_path / "model.py")
    assert ops_hash(tmp_path) == ops_hash(ROOT)
    (tmp_path / "model.py").write_text("# not an op source\n")
    assert ops_hash(tmp_path) == ops_hash(ROOT)
    attention = tmp_path / "gpt2_fused/kernels/attention.py"
    text = attention.read_text()
    assert "def _proj_backward" in text  # a register_autograd backward: outside torch's key
    attention.write_text(text.replace("def _proj_backward", "def _proj_backward_renamed"))
    edited = ops_hash(tmp_path)
    assert edited != ops_hash(ROOT) and len(edited) == 12
    (tmp_path / "fused_loss/extra.py").write_text("")  # a new file counts too
    assert ops_hash(tmp_path) not in (edited, ops_hash(ROOT))


def test_torch_caches_in_the_keyed_folder(monkeypatch, tmp_path):
    """Under torch's own default folder, or under the one the user set; a second call, or one
    in a process that inherited another checkout's folder, gives this checkout's."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv(ENV, raising=False)
    keyed = use_keyed_cache()
    assert keyed == os.path.join(default_cache_dir(), PREFIX + ops_hash())
    assert cache_dir() == keyed  # what Inductor and AOTAutograd write under
    assert use_keyed_cache() == keyed
    monkeypatch.setenv(ENV, str(tmp_path / "mine" / (PREFIX + "0123456789ab")))
    assert use_keyed_cache() == str(tmp_path / "mine" / (PREFIX + ops_hash()))
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert use_keyed_cache() == cache_dir() == str(tmp_path / "mine" / (PREFIX + ops_hash()))


def test_train_compiles_under_the_keyed_folder(monkeypatch, tmp_path, tiny_args):
    seen = []

    def fake_compile(model, mode=None):  # records the folder instead of compiling on CPU
        seen.append(os.environ.get(ENV))
        return model

    monkeypatch.setattr(train.torch, "compile", fake_compile)
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    args = tiny_args + [f"--out_dir={tmp_path}", "--max_steps=1", "--eval_interval=0"]
    train.main(args + ["--compile=True"])
    assert seen == [str(tmp_path / "cache" / (PREFIX + ops_hash()))]


def test_every_op_of_the_package_is_in_the_hashed_sources():
    """A torch.library op defined outside OP_SOURCES would be missed by the hash."""
    defines = re.compile(r"@(torch\.library\.)?(custom_op|triton_op)\(|\.register_autograd\(")
    files = [
        *ROOT.glob("*.py"),
        *(ROOT / "gpt2_fused").rglob("*.py"),
        *(ROOT / "data").rglob("*.py"),
    ]
    found = {p.relative_to(ROOT).as_posix() for p in files if defines.search(p.read_text())}
    assert "gpt2_fused/kernels/mlp.py" in found  # the scan sees them
    assert [p for p in found if not p.startswith(tuple(f + "/" for f in OP_SOURCES))] == []
