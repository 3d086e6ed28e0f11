"""Token shards in the llm.c / modded-nanogpt format.

Layout of a shard file (little-endian):
    header: 256 x int32 = [MAGIC, VERSION, ntok, 0, ..., 0]   (1024 bytes)
    body:   ntok x uint16 GPT-2 token ids, each document starting with <|endoftext|> (50256)
so the file is exactly 1024 + 2 * ntok bytes. By convention shard 0 of a dataset is validation.
"""

import os
from pathlib import Path

import numpy as np

from data.tokenizer import VOCAB_SIZE

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


class DataError(ValueError):
    """Input data that cannot be used as it is; the message names the file and the problem."""


class ShardError(DataError):
    """A shard file that is not a valid llm.c token shard; the message names the file and how to
    rebuild it."""

    def __init__(self, problem):
        super().__init__(f"{problem}; {REBUILD}")


# data/embedded.py rebuilds its own cache; other shards come from one of these commands
REBUILD = (
    "rebuild it with the command that prepared it (python -m data.fineweb, python -m "
    "data.tinystories, or python -m data.fineweb --from-text ...)"
)


def write_shard(path, tokens):
    """Write `tokens` (1-D ints in [0, 50257)) as a shard at `path`, atomically.

    The bytes go to a temporary file that is fsynced and then renamed over `path`, so an interrupted
    write never leaves a partial shard under the final name.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
        raise ValueError(
            f"{path}: token ids must be in [0, {VOCAB_SIZE}), got [{tokens.min()}, {tokens.max()}]"
        )
    if tokens.size >= 2**31:
        raise ValueError(f"{path}: {tokens.size} tokens do not fit the int32 header count")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2", copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_header(path):
    """Validate magic, version and file size of the shard at `path`; return its token count."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"shard not found: {path}") from None
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes is too small for the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic {header[0]}, expected {MAGIC} (not an llm.c shard?)")
    if header[1] != VERSION:
        raise ShardError(f"{path}: unsupported version {header[1]}, expected {VERSION}")
    ntok = int(header[2])
    expected = HEADER_BYTES + 2 * ntok
    if ntok < 0 or size != expected:
        raise ShardError(
            f"{path}: header says {ntok} tokens ({expected} bytes) but the file has {size} bytes"
            " (truncated or corrupt)"
        )
    return ntok


def read_shard(path):
    """Validate the shard at `path` and return its tokens as a read-only uint16 memmap (ntok,).

    Every id is checked to be < 50257 (one vectorised pass over the file), so a corrupt shard fails
    here instead of as an out-of-range embedding lookup mid-training.
    """
    ntok = read_header(path)
    if ntok == 0:
        return np.zeros(0, dtype=np.uint16)
    tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(ntok,))
    top = int(tokens.max())
    if top >= VOCAB_SIZE:
        where = int(np.argmax(tokens >= VOCAB_SIZE))
        raise ShardError(
            f"{path}: token id {tokens[where]} at position {where} is >= vocab size {VOCAB_SIZE}"
        )
    return tokens
