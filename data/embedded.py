"""The embedded default dataset: Wikipedia text shipped in data/embedded/, tokenised on first use.

The shards go to data/cache/embedded-<hash>/ (or $GPT2_FUSED_CACHE/embedded-<hash>/), where <hash>
covers the text files and the pipeline version, so edited text never reuses stale shards. Several
processes (e.g. DDP ranks) may prepare at once: each works in its own temporary folder and renames
it into place; the first rename wins and the others discard their identical copies. A folder under
the final name is therefore complete when written; its manifest.json (each shard's SHA-256) finds
one damaged later (a truncated or overwritten shard), which is then set aside and rebuilt.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from data.prepare import CACHE_DIR, iter_file_docs, prepare

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
TRAIN_FILE = EMBEDDED_DIR / "wiki_train.txt.xz"
VAL_FILE = EMBEDDED_DIR / "wiki_val.txt.xz"
PIPELINE_VERSION = "1"  # bump when the tokenisation or shard layout changes
MANIFEST = "manifest.json"  # {shard file name: SHA-256}, written with the shards


def embedded_dir(cache_dir=None):
    """Where the embedded dataset's shards live (prepared or not); default under CACHE_DIR."""
    h = hashlib.sha256(PIPELINE_VERSION.encode())
    for path in (TRAIN_FILE, VAL_FILE):
        if not path.is_file():
            raise FileNotFoundError(f"embedded dataset file missing: {path}")
        h.update(path.read_bytes())
    return Path(cache_dir or CACHE_DIR) / f"embedded-{h.hexdigest()[:12]}"


def prepare_embedded(cache_dir=None, workers=1):
    """Return the folder of the embedded dataset's shards, tokenising them first if needed."""
    # workers=1: ~2 s in-process, as fast as a pool here (2 cores) and no fork inside a trainer.
    final = embedded_dir(cache_dir)
    if final.is_dir():
        damage = _damage(final)
        if damage is None:
            return final
        print(f"the embedded dataset's cache is damaged or old ({damage}): rebuilding {final}")
        aside = final.with_name(f".{final.name}.damaged.{os.getpid()}")
        try:
            os.rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError:  # another process set it aside first
            pass
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp.", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any other folder
    try:
        print(f"preparing the embedded dataset into {final} (first use only)")
        prepare(
            iter_file_docs([TRAIN_FILE], "text"),
            tmp,
            "embedded",
            val_docs=iter_file_docs([VAL_FILE], "text"),
            workers=workers,
            progress=False,
        )
        digests = {f.name: _sha256(f) for f in sorted(tmp.glob("*.bin"))}
        (tmp / MANIFEST).write_text(json.dumps(digests, indent=1) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not "another process got there first"
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _damage(folder):
    """None if every shard in folder's manifest is there with its SHA-256 (1.9M tokens: a few ms),
    else what is wrong, naming the file."""
    try:
        want = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{folder / MANIFEST} missing or unreadable"
    for name, digest in want.items():
        try:
            if _sha256(folder / name) != digest:
                return f"{folder / name} differs from its manifest"
        except OSError:
            return f"{folder / name} missing"
    return None if want else f"{folder / MANIFEST} lists no shard"
