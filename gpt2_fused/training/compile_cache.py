"""torch.compile's on-disk caches, kept apart per version of this repository's custom ops.

Inductor and AOTAutograd reuse a compiled graph from disk across runs when the traced graph is
the same, but a custom op enters that key by its name and schema only: the Python behind it (its
register_autograd backward, its fake function) does not (pytorch/pytorch#144344, open). After an
edit to an op's backward, or a `git pull` that changes one, the next run could load the graph
traced from the old code: gradients from the old formula, or a call to an op that no longer
exists (seen on the H200: bench/RESULTS.md#compile-cache). So each run caches in a folder of its
own per hash of the files that define the ops; an unchanged checkout keeps reusing its cache.

    use_keyed_cache()   before the first torch.compile of a process: sets TORCHINDUCTOR_CACHE_DIR
"""

import getpass
import hashlib
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OP_SOURCES = ("fused_loss", "gpt2_fused/kernels")  # where every torch.library op is defined
ENV = "TORCHINDUCTOR_CACHE_DIR"
PREFIX = "gpt2_fused-"


def ops_hash(root=ROOT):
    """12 hex digits of a SHA-256 over the op sources' relative paths and bytes."""
    h = hashlib.sha256()
    for folder in OP_SOURCES:
        for path in sorted((Path(root) / folder).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _torch_default():
    """The folder torch uses when ENV is unset: <temp dir>/torchinductor_<user>."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name (e.g. an unnamed uid in a container)
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + user)


def use_keyed_cache(root=ROOT):
    """Point ENV at <ENV or torch's default>/gpt2_fused-<ops_hash> and return it. A folder that
    an earlier call set (inherited by a torchrun worker or a subprocess, maybe from another
    checkout) is replaced by this checkout's beside it. torch fixes its cache folder at the
    first compile, so this comes before."""
    base = Path(os.environ.get(ENV) or _torch_default()).absolute()
    if base.name.startswith(PREFIX):
        base = base.parent
    os.environ[ENV] = str(base / (PREFIX + ops_hash(root)))
    return os.environ[ENV]
