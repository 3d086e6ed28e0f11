"""Tests for data/: tokenizer, shard format, prepare pipeline, loader, embedded dataset.

References are built independently of the code under test: shard bytes with struct, loader windows
with plain numpy slicing, token ids from values published for GPT-2 and from the HF `tokenizers`
BPE implementation (hard-coded below, and re-checked live when `tokenizers` is installed).
"""

import gzip
import json
import lzma
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import data.embedded
import data.prepare
import data.shards
import data.tokenizer
from data import resolve_dataset
from data.loader import DataLoader, iter_val_batches
from data.prepare import iter_file_docs, iter_jsonl_docs, iter_text_docs, prepare
from data.shards import ShardError, read_header, read_shard, write_shard
from data.tokenizer import EOT, check_bpe_files, get_tokenizer
from gpt2_fused.training.errors import UsageError

FIXTURES = Path(__file__).parent / "fixtures"
WIKI = FIXTURES / "wiki_sample.txt"
STORIES = FIXTURES / "stories_sample.txt"
JSONL = FIXTURES / "docs_sample.jsonl"

# Mixed ASCII / accents / CJK / emoji / whitespace runs / a literal special token / contractions.
TRICKY = (
    "Hello world! It's 2024: naïve café, 東京, emoji 🙂\n\n  tabs\tand   spaces?\r\n"
    "<|endoftext|> don't they'll"
)
# Ids from HF `tokenizers` (Rust BPE + ByteLevel pre-tokenizer) on the same encoder.json/vocab.bpe.
TRICKY_IDS = [
    15496, 995, 0, 632, 338, 48609, 25, 41492, 40304, 11, 10545, 251, 109, 12859, 105, 11, 44805,
    32485, 628, 220, 22524, 197, 392, 220, 220, 9029, 30, 201, 198, 27, 91, 437, 1659, 5239, 91, 29,
    836, 470, 484, 1183,
]  # fmt: skip


def enc_doc(text):
    """Reference tokenisation of one document as the shards store it."""
    return [EOT] + get_tokenizer().encode_ordinary(text)


def shard_bytes(tokens, magic=20240520, version=1, count=None):
    """An llm.c shard built by hand: 256 little-endian int32 then uint16 tokens."""
    header = [magic, version, len(tokens) if count is None else count] + [0] * 253
    return struct.pack("<256i", *header) + struct.pack(f"<{len(tokens)}H", *tokens)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_known_ids():
    enc = get_tokenizer()
    assert enc.n_vocab == 50257 and enc.eot_token == EOT == 50256
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262] and enc.encode_ordinary("!") == [0]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.encode_ordinary(TRICKY) == TRICKY_IDS
    assert enc.decode(TRICKY_IDS) == TRICKY
    assert get_tokenizer() is enc  # built once per process


def test_tokenizer_matches_hf_tokenizers_on_fixtures():
    tokenizers = pytest.importorskip("tokenizers")
    bpe = data.tokenizer.BPE_DIR
    hf = tokenizers.Tokenizer(
        tokenizers.models.BPE.from_file(str(bpe / "encoder.json"), str(bpe / "vocab.bpe"))
    )
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    enc = get_tokenizer()
    for path in (WIKI, STORIES, JSONL):
        text = path.read_text(encoding="utf-8")
        ids = enc.encode_ordinary(text)
        assert ids == hf.encode(text).ids
        assert enc.decode(ids) == text


def test_bpe_files_checked(tmp_path):
    check_bpe_files()
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(data.tokenizer.BPE_DIR / name, tmp_path / name)
    check_bpe_files(tmp_path)
    raw = bytearray((tmp_path / "vocab.bpe").read_bytes())
    raw[100] ^= 1
    (tmp_path / "vocab.bpe").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="vocab.bpe.*sha256"):
        check_bpe_files(tmp_path)
    (tmp_path / "encoder.json").unlink()
    with pytest.raises(FileNotFoundError, match="encoder.json"):
        check_bpe_files(tmp_path)


# ---------------------------------------------------------------- shards


def test_shard_write_matches_hand_built_bytes(tmp_path):
    tokens = [EOT, 0, 1, 65, 50255, EOT, 42]
    write_shard(tmp_path / "a.bin", np.array(tokens))
    assert (tmp_path / "a.bin").read_bytes() == shard_bytes(tokens)
    (tmp_path / "b.bin").write_bytes(shard_bytes(tokens))
    out = read_shard(tmp_path / "b.bin")
    assert out.dtype == np.uint16 and out.tolist() == tokens
    assert read_header(tmp_path / "b.bin") == len(tokens)
    write_shard(tmp_path / "empty.bin", np.array([], dtype=np.int64))
    assert read_shard(tmp_path / "empty.bin").size == 0


@pytest.mark.parametrize(
    "raw, match",
    [
        (shard_bytes([1, 2, 3], magic=20240521), "bad magic 20240521"),
        (shard_bytes([1, 2, 3], version=2), "unsupported version 2"),
        (shard_bytes([1, 2, 3])[:-2], "truncated or corrupt"),
        (shard_bytes([1, 2, 3]) + b"\0\0", "truncated or corrupt"),
        (shard_bytes([1, 2, 3], count=-1), "truncated or corrupt"),
        (shard_bytes([])[:1000], "too small for the 1024-byte header"),
        (shard_bytes([EOT, 5, 50257, 7]), "token id 50257 at position 2"),
        (shard_bytes([EOT, 65535]), "token id 65535 at position 1"),
    ],
)
def test_shard_corruption_errors_name_the_file(tmp_path, raw, match):
    path = tmp_path / "bad_shard_000001.bin"
    path.write_bytes(raw)
    with pytest.raises(ShardError, match=match) as err:
        read_shard(path)
    assert str(path) in str(err.value)


def test_shard_missing_and_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        read_shard(tmp_path / "nope.bin")
    with pytest.raises(ValueError, match=r"\[0, 50257\)"):
        write_shard(tmp_path / "x.bin", np.array([1, 50257]))
    with pytest.raises(ValueError, match=r"\[0, 50257\)"):
        write_shard(tmp_path / "x.bin", np.array([-1, 3]))
    with pytest.raises(ValueError, match="1-D"):
        write_shard(tmp_path / "x.bin", np.zeros((2, 2), dtype=np.int64))
    assert list(tmp_path.iterdir()) == []


def test_shard_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "s_train_000001.bin"
    write_shard(path, np.array([EOT, 1, 2]))

    def crash(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(data.shards.os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        write_shard(path, np.arange(1000))
    assert read_shard(path).tolist() == [EOT, 1, 2]  # old shard untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left
    with pytest.raises(KeyboardInterrupt):
        write_shard(tmp_path / "new.bin", np.arange(10))
    assert not (tmp_path / "new.bin").exists()


# ---------------------------------------------------------------- document readers

WIKI_DOCS = [
    "Lighthouse\n\nA lighthouse is a tower",
    "Sourdough\n\nSourdough bread rises",
    "Prime number\n\nA prime number is",
]
STORY_STARTS = ["Mia had a red kite.", "Tom found a small", "The old cat slept"]
JSONL_STARTS = ["Glaciers move", "A violin has four", "Honeybees tell"]


def starts(docs, prefixes):
    return len(docs) == len(prefixes) and all(
        d.startswith(p) for d, p in zip(docs, prefixes, strict=True)
    )


def test_text_formats(tmp_path):
    wiki = list(iter_text_docs(WIKI))
    assert starts(wiki, WIKI_DOCS)  # title line kept once, the title-only stub dropped
    assert wiki[0].endswith("some have become museums.") and "</doc>" not in "".join(wiki)
    stories = list(iter_text_docs(STORIES))
    assert starts(stories, STORY_STARTS)  # the empty story between two separators is dropped
    assert stories[0].endswith("Mia laughed all the way home.")
    assert starts(list(iter_jsonl_docs(JSONL)), JSONL_STARTS)  # empty / blank texts skipped
    single = tmp_path / "one.txt"
    single.write_text("\n\nJust one document.\nTwo lines.\n")
    assert list(iter_text_docs(single)) == ["Just one document.\nTwo lines."]


def test_compressed_inputs_read_transparently(tmp_path):
    for src, opener, suffix in ((WIKI, lzma.open, ".xz"), (JSONL, gzip.open, ".gz")):
        dst = tmp_path / (src.name + suffix)
        with opener(dst, "wb") as f:
            f.write(src.read_bytes())
        assert list(iter_file_docs([dst], "auto")) == list(iter_file_docs([src], "auto"))


def test_malformed_inputs(tmp_path):
    bad = tmp_path / "cut.txt"
    bad.write_text(WIKI.read_text().rsplit("</doc>", 1)[0])
    with pytest.raises(ValueError, match="cut.txt.*inside a <doc>"):
        list(iter_text_docs(bad))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(iter_jsonl_docs(bad_json))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        list(iter_file_docs([tmp_path / "missing.txt"], "text"))


# ---------------------------------------------------------------- prepare pipeline


def read_dir(out_dir):
    """(name, tokens) of every .bin in out_dir, in name order after sorting by shard index."""
    files = sorted(Path(out_dir).glob("*.bin"), key=lambda p: p.stem.rsplit("_", 1)[1])
    return [(p.name, read_shard(p).tolist()) for p in files]


def test_prepare_separate_val_packs_shards(tmp_path):
    val_docs = list(iter_text_docs(STORIES))
    train_docs = list(iter_text_docs(WIKI)) + list(iter_jsonl_docs(JSONL))
    val_ref = [t for d in val_docs for t in enc_doc(d)]
    train_ref = [t for d in train_docs for t in enc_doc(d)]
    paths = prepare(train_docs, tmp_path, "ts", val_docs=val_docs, shard_size=64, workers=1)
    shards = read_dir(tmp_path)
    assert [p.name for p in paths] == [name for name, _ in shards]
    val = [s for s in shards if "_val_" in s[0]]
    train = [s for s in shards if "_train_" in s[0]]
    assert [name for name, _ in shards[: len(val)]] == [name for name, _ in val]  # val first
    assert [name for name, _ in shards] == [
        f"ts_{'val' if i < len(val) else 'train'}_{i:06d}.bin" for i in range(len(shards))
    ]
    assert sum((t for _, t in val), []) == val_ref
    assert sum((t for _, t in train), []) == train_ref
    assert all(len(t) == 64 for _, t in val[:-1] + train[:-1])  # only each split's last is short
    assert train[0][1][0] == EOT


def test_prepare_val_from_head_and_pool(tmp_path):
    docs = list(iter_text_docs(WIKI)) + list(iter_text_docs(STORIES))
    lengths = [len(enc_doc(d)) for d in docs]
    val_tokens = lengths[0] + 1  # needs two whole documents
    prepare(docs, tmp_path / "a", "x", val_tokens=val_tokens, shard_size=50, workers=1)
    prepare(docs, tmp_path / "b", "x", val_tokens=val_tokens, shard_size=50, workers=2)
    a, b = read_dir(tmp_path / "a"), read_dir(tmp_path / "b")
    assert a == b  # the process pool changes nothing
    val = sum((t for n, t in a if "_val_" in n), [])
    assert val == enc_doc(docs[0]) + enc_doc(docs[1])
    assert sum((t for n, t in a if "_train_" in n), []) == [t for d in docs[2:] for t in enc_doc(d)]
    prepare(docs, tmp_path / "c", "x", val_tokens=lengths[0], shard_size=50, workers=1)
    assert sum((t for n, t in read_dir(tmp_path / "c") if "_val_" in n), []) == enc_doc(docs[0])


def test_prepare_errors(tmp_path):
    docs = list(iter_text_docs(WIKI))
    with pytest.raises(ValueError, match="no training documents"):
        prepare(docs, tmp_path / "a", "x", val_tokens=10**6, workers=1)
    with pytest.raises(ValueError, match="validation documents are empty"):
        prepare(docs, tmp_path / "b", "x", val_docs=[], workers=1)
    prepare(docs, tmp_path / "c", "x", val_tokens=5, shard_size=100, workers=1)
    with pytest.raises(ValueError, match="other settings"):
        prepare(docs, tmp_path / "c", "x", val_tokens=5, shard_size=99, workers=1)


def test_a_prepare_stopped_by_its_input_leaves_nothing_in_the_way(tmp_path):
    """A DataError (too few documents, a bad file) removes what that call wrote: a rerun with
    other settings is not refused, and one after a resumed start finds the state it left."""
    docs = list(iter_text_docs(WIKI))
    out = tmp_path / "a"
    with pytest.raises(ValueError, match="no training documents"):
        prepare(docs, out, "x", val_tokens=10**6, shard_size=100, workers=1)  # 2+ val shards
    assert not out.exists()
    prepare(docs, out, "x", val_tokens=5, shard_size=100, workers=1)  # not "other settings"

    kw = dict(val_tokens=60, shard_size=37, workers=1)
    with pytest.raises(Crash):  # a crash (network, Ctrl-C) keeps its shards: a rerun resumes
        prepare(crashing(docs * 3, 4), tmp_path / "b", "r", **kw)
    kept = read_dir(tmp_path / "b")
    state = (tmp_path / "b" / "r_prepare.json").read_text()

    def bad_file(docs):
        yield from docs
        raise data.shards.DataError("broken.txt: not UTF-8 text")

    with pytest.raises(ValueError, match="broken.txt"):
        prepare(bad_file(docs * 3), tmp_path / "b", "r", **kw)
    assert read_dir(tmp_path / "b") == kept
    assert (tmp_path / "b" / "r_prepare.json").read_text() == state


class Crash(Exception):
    pass


def crashing(docs, after):
    """Yield `after` documents, then fail like an interrupted run."""
    for i, d in enumerate(docs):
        if i == after:
            raise Crash
        yield d


def count_tokenize_calls(monkeypatch):
    calls = []
    real = data.prepare.tokenize

    def counting(text):
        calls.append(text)
        return real(text)

    monkeypatch.setattr(data.prepare, "tokenize", counting)
    return calls


def test_prepare_resumes_after_interruption(tmp_path, monkeypatch):
    docs = (list(iter_text_docs(WIKI)) + list(iter_text_docs(STORIES))) * 3
    kw = dict(val_tokens=60, shard_size=37, workers=1, settings={"input": "fixture"})
    prepare(docs, tmp_path / "ref", "r", **kw)
    reference = read_dir(tmp_path / "ref")

    out = tmp_path / "run"
    with pytest.raises(Crash):
        prepare(crashing(docs, 11), out, "r", **kw)
    partial = read_dir(out)
    assert 0 < len(partial) < len(reference)
    assert partial == reference[: len(partial)]  # every shard under a final name is complete
    state = json.loads((out / "r_prepare.json").read_text())
    assert not state["complete"] and len(state["shards"]) == len(partial)
    assert not [p for p in out.iterdir() if ".tmp" in p.name]

    calls = count_tokenize_calls(monkeypatch)
    prepare(iter(docs), out, "r", **kw)
    assert read_dir(out) == reference
    resumed_at = state["shards"][-1]["next_doc"]
    assert calls == docs[resumed_at:]  # finished documents are skipped, not re-tokenised

    calls.clear()
    prepare(iter(docs), out, "r", **kw)  # complete: nothing is read or written
    assert calls == [] and read_dir(out) == reference


def test_prepare_interrupted_shard_write_and_damaged_shard(tmp_path, monkeypatch):
    docs = list(iter_text_docs(WIKI)) * 4
    kw = dict(val_tokens=40, shard_size=33, workers=1)
    prepare(docs, tmp_path / "ref", "r", **kw)
    reference = read_dir(tmp_path / "ref")

    real_write, n = data.prepare.write_shard, []

    def write_then_die(path, tokens):
        n.append(path)
        if len(n) == 4:  # die inside the 4th shard write, after its bytes hit the temp file
            monkeypatch.setattr(data.shards.os, "fsync", lambda fd: (_ for _ in ()).throw(Crash))
        real_write(path, tokens)

    monkeypatch.setattr(data.prepare, "write_shard", write_then_die)
    out = tmp_path / "run"
    with pytest.raises(Crash):
        prepare(docs, out, "r", **kw)
    monkeypatch.undo()
    assert not n[3].exists() and len(read_dir(out)) == 3
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [name for name, _ in reference[:3]] + ["r_prepare.json"]
    )
    shard1 = out / reference[1][0]
    shard1.write_bytes(shard1.read_bytes()[:-2])  # damage a finished shard: it and later are redone
    prepare(docs, out, "r", **kw)
    assert read_dir(out) == reference


def test_prepare_cli_fineweb_and_tinystories(tmp_path, capsys):
    from data import fineweb, tinystories

    wiki_xz = tmp_path / "wiki.txt.xz"
    with lzma.open(wiki_xz, "wb") as f:
        f.write(WIKI.read_bytes())
    args = ["--from-text", str(wiki_xz), "--val-from", str(JSONL), "--no-progress"]
    fineweb.main(args + ["--out-dir", str(tmp_path / "fw"), "--shard-size", "40", "--workers", "1"])
    shards = read_dir(tmp_path / "fw")
    assert shards[0][0] == "local_val_000000.bin"
    assert sum((t for n, t in shards if "_val_" in n), []) == [
        t for d in iter_jsonl_docs(JSONL) for t in enc_doc(d)
    ]
    assert sum((t for n, t in shards if "_train_" in n), []) == [
        t for d in iter_text_docs(WIKI) for t in enc_doc(d)
    ]
    fineweb.main(args + ["--out-dir", str(tmp_path / "fw"), "--shard-size", "40", "--workers", "1"])
    assert "already prepared" in capsys.readouterr().out

    tinystories.main(
        ["--from-text", str(STORIES), "--val-tokens", "5", "--out-dir", str(tmp_path / "ts")]
        + ["--workers", "1", "--no-progress"]
    )
    stories = list(iter_text_docs(STORIES))
    assert read_dir(tmp_path / "ts") == [
        ("tinystories_val_000000.bin", enc_doc(stories[0])),
        ("tinystories_train_000001.bin", enc_doc(stories[1]) + enc_doc(stories[2])),
    ]
    assert capsys.readouterr().out.endswith(
        f"in {tmp_path / 'ts'}; train on them with --dataset={tmp_path / 'ts'}\n"
    )
    with pytest.raises(UsageError, match="^argument --shard-size: must be a whole number >= 1, "):
        fineweb.main(["--from-text", str(STORIES), "--shard-size=-1"])
    with pytest.raises(UsageError, match="^input file not found: "):
        fineweb.main(["--from-jsonl", str(tmp_path / "nope.jsonl"), "--out-dir", str(tmp_path)])


# ---------------------------------------------------------------- loader


def make_shards(tmp_path, sizes, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 50257, n, dtype=np.int64) for n in sizes]
    for i, a in enumerate(arrays):
        write_shard(tmp_path / f"t_train_{i + 1:06d}.bin", a)
    return str(tmp_path / "t_train_*.bin"), arrays


def reference_windows(arrays, B, T, W, rank, steps):
    """llm.c order by direct slicing: (x, y, epoch) for `steps` steps of one rank."""
    out, epoch = [], 0
    while len(out) < steps:
        for a in arrays:
            pos = 0
            while pos + B * T * W + 1 <= len(a) and len(out) < steps:
                w = a[pos + rank * B * T : pos + rank * B * T + B * T + 1]
                out.append((w[:-1].reshape(B, T), w[1:].reshape(B, T), epoch))
                pos += B * T * W
        epoch += 1
    return out


@pytest.mark.parametrize("B, T, W", [(2, 16, 1), (3, 8, 2), (1, 32, 3), (4, 5, 4)])
def test_loader_unshuffled_matches_numpy_reference(tmp_path, B, T, W):
    """shuffle=False: the contiguous order the loader had before it shuffled, token for token."""
    step = B * T * W  # a shard of exactly k steps + 1 token holds k steps, of k steps only k - 1
    pattern, arrays = make_shards(tmp_path, [1000, 401, 5 * step + 1, 777, 5 * step])
    steps = 0
    for a in arrays:
        steps += (len(a) - 1) // (B * T * W)
    steps = 2 * steps + 3  # two full epochs and a bit: wraps to the first shard twice
    for rank in range(W):
        loader = DataLoader(pattern, B, T, rank=rank, world_size=W, shuffle=False)
        for x_ref, y_ref, epoch in reference_windows(arrays, B, T, W, rank, steps):
            x, y = loader.next_batch()
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
            assert x.is_contiguous() and y.is_contiguous()
            assert np.array_equal(x.numpy(), x_ref) and np.array_equal(y.numpy(), y_ref)
            assert loader.epoch == epoch
        assert loader.epoch == 2
        loader.reset()
        x, _ = loader.next_batch()
        assert loader.epoch == 0 and np.array_equal(
            x.numpy(), reference_windows(arrays, B, T, W, rank, 1)[0][0]
        )


def test_loader_unshuffled_ranks_read_disjoint_contiguous_blocks(tmp_path):
    pattern, arrays = make_shards(tmp_path, [5000])
    B, T, W = 2, 10, 3
    loaders = [DataLoader(pattern, B, T, rank=r, world_size=W, shuffle=False) for r in range(W)]
    for step in range(3):
        block = torch.cat([ld.next_batch()[0].reshape(-1) for ld in loaders])
        start = step * B * T * W
        assert np.array_equal(block.numpy(), arrays[0][start : start + B * T * W])


@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_resumes_exactly(tmp_path, shuffle):
    pattern, _ = make_shards(tmp_path, [600, 300, 450])
    B, T, W = 2, 12, 2
    for rank in range(W):
        for k in (0, 5, 11, 17, 26, 27, 30):  # 27 steps per epoch: around shard changes and wraps
            a = DataLoader(pattern, B, T, rank=rank, world_size=W, shuffle=shuffle, seed=7)
            for _ in range(k):
                a.next_batch()
            ckpt = tmp_path / "ckpt.pt"
            torch.save({"loader": a.state_dict()}, ckpt)
            expected = [a.next_batch() for _ in range(25)]
            state = torch.load(ckpt, weights_only=True)["loader"]
            assert all(isinstance(v, (int, str)) for v in state.values())
            b = DataLoader(pattern, B, T, rank=rank, world_size=W, shuffle=shuffle, seed=7)
            b.next_batch()  # a fresh loader that already moved: state must override it
            assert b.load_state_dict(state) is None  # the order it was made with: no notice
            for (x1, y1), (x2, y2) in zip(
                expected, (b.next_batch() for _ in range(25)), strict=True
            ):
                assert torch.equal(x1, x2) and torch.equal(y1, y2)
            assert a.epoch == b.epoch == (k + 25) // 27 and a.state_dict() == b.state_dict()


# ---------------------------------------------------------------- loader: the shuffled order


def make_counting_shards(tmp_path, sizes):
    """Shards whose tokens count up across them (0, 1, 2, ... over all shards), so a row's first
    token names its window: shard k, window (x[0] - starts[k]) // T. Returns pattern, starts."""
    starts = np.cumsum([0, *sizes])
    assert starts[-1] <= 50257
    for i, n in enumerate(sizes):
        write_shard(tmp_path / f"c_train_{i + 1:06d}.bin", np.arange(starts[i], starts[i] + n))
    return str(tmp_path / "c_train_*.bin"), starts[:-1]


def epoch_windows(loaders, steps):
    """The first tokens of the rows the loaders (one per rank) give in `steps` steps: (steps, W*B),
    rank 0's rows first in each step; each row is checked to be a whole window."""
    out = []
    for _ in range(steps):
        rows = []
        for ld in loaders:
            x, y = ld.next_batch()
            T = x.shape[1]
            assert torch.equal(x, x[:, :1] + torch.arange(T)) and torch.equal(y, x + 1)
            rows += x[:, 0].tolist()
        out.append(rows)
    return np.array(out)


SIZES = [1000, 401, 161, 777]  # 124, 50, 20, 97 windows at T=8: 10 + 4 + 1 + 8 = 23 steps of 12


@pytest.mark.parametrize("B, W", [(12, 1), (6, 2), (3, 4), (4, 3)])
def test_shuffled_epoch_draws_each_window_at_most_once(tmp_path, B, W):
    """One epoch over all ranks: whole windows at stride T, none twice, each shard's windows all
    but a tail of fewer than B*W, the shards one after another; the rows are not in order."""
    pattern, starts = make_counting_shards(tmp_path, SIZES)
    T = 8
    loaders = [DataLoader(pattern, B, T, rank=r, world_size=W, seed=3) for r in range(W)]
    firsts = epoch_windows(loaders, 23)
    assert all(ld.epoch == 0 for ld in loaders)
    flat = firsts.reshape(-1)
    assert len(set(flat.tolist())) == flat.size  # disjoint across steps and ranks
    shard = np.searchsorted(starts, flat, side="right") - 1
    assert np.all((flat - starts[shard]) % T == 0)  # windows at stride T
    runs = shard[np.r_[True, shard[1:] != shard[:-1]]]
    assert sorted(runs.tolist()) == [0, 1, 2, 3]  # each shard once, in one run of steps
    for k, n in enumerate(SIZES):
        n_windows, used = (n - 1) // T, np.sum(shard == k)
        assert used == n_windows // (B * W) * (B * W) and n_windows - used < B * W
    assert not np.all(np.diff(flat[shard == runs[0]]) == T)  # shuffled, not contiguous
    epoch_windows(loaders, 1)
    assert all(ld.epoch == 1 for ld in loaders)


def test_shuffled_order_is_seeded_new_each_epoch_and_independent_of_B_and_W(tmp_path):
    pattern, _ = make_counting_shards(tmp_path, SIZES)
    T, steps = 8, 23  # an epoch

    def order(seed, B=12, W=1):
        lds = [DataLoader(pattern, B, T, rank=r, world_size=W, seed=seed) for r in range(W)]
        return epoch_windows(lds, 3 * steps).reshape(3, -1)  # (epoch, the epoch's windows)

    a = order(1)
    assert np.array_equal(a, order(1))  # deterministic
    assert np.array_equal(a, order(1, B=6, W=2))  # the same global order for any B and W
    assert np.array_equal(a, order(1, B=3, W=4))
    for e in (1, 2):  # a new permutation each epoch (of mostly the same windows: tails differ)
        assert not np.array_equal(a[e], a[0])
        assert len(set(a[e].tolist()) & set(a[0].tolist())) > 0.8 * a.shape[1]
    assert not np.array_equal(order(2)[0], a[0])  # another seed, another order


def test_shuffled_resume_with_another_world_size_continues_the_epoch(tmp_path):
    """2 ranks x B=6 for 5 steps, then resumed on 1 rank x B=12, 4 ranks x B=3 or 1 x B=5: the
    windows continue exactly where they stopped; one epoch has still no window twice."""
    pattern, _ = make_counting_shards(tmp_path, [1000])  # 124 windows
    T = 8
    ref = epoch_windows([DataLoader(pattern, 12, T, seed=5)], 10).reshape(-1)  # 120 windows
    two = [DataLoader(pattern, 6, T, rank=r, world_size=2, seed=5) for r in range(2)]
    before = epoch_windows(two, 5).reshape(-1)
    assert np.array_equal(before, ref[:60])
    for B, W in ((12, 1), (3, 4), (5, 1)):
        lds = [DataLoader(pattern, B, T, rank=r, world_size=W, seed=5) for r in range(W)]
        for ld in lds:
            assert ld.load_state_dict(two[0].state_dict()) is None  # rank 0's state, all ranks
        after = epoch_windows(lds, 60 // (B * W)).reshape(-1)
        assert np.array_equal(after, ref[60 : 60 + len(after)])


def test_loader_state_from_before_shuffling_resumes_in_order_with_a_notice(tmp_path):
    """A state as the unshuffled loader wrote it (a token "position", no shuffle keys) continues
    sequentially in a loader made to shuffle, and says so once; one written by a loader with
    another seed continues in its order with a notice too. T may only change unshuffled."""
    pattern, arrays = make_shards(tmp_path, [600, 300, 450])
    B, T = 2, 12
    seq = DataLoader(pattern, B, T, shuffle=False)
    for _ in range(30):  # into epoch 1, shard 1
        seq.next_batch()
    new = seq.state_dict()
    old = {k: new[k] for k in ("shard", "epoch", "shard_name", "num_shards")}
    old["position"] = new["window"] * T
    expected = [seq.next_batch()[0] for _ in range(30)]
    loader = DataLoader(pattern, B, T, seed=1)
    note = loader.load_state_dict(old)
    assert "predates shuffling" in note and "sequential" in note and "\n" not in note
    assert all(torch.equal(x, loader.next_batch()[0]) for x in expected)
    assert loader.state_dict()["shuffle"] is False  # and it stays so in the next checkpoint
    assert DataLoader(pattern, B, T, shuffle=False).load_state_dict(old) is None

    a = DataLoader(pattern, B, T, seed=1)
    a.next_batch()
    b = DataLoader(pattern, B, T, seed=2)
    assert b.load_state_dict(a.state_dict()) == (
        "loader state has shuffle=True, seed=1: this run continues that order"
    )
    assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(ValueError, match="T=12, this loader has T=6"):
        DataLoader(pattern, B, 6).load_state_dict(a.state_dict())
    # unshuffled, another T resumes at the same token offset (rounded up to a whole window)
    other_t = DataLoader(pattern, B, 5, shuffle=False)
    other_t.load_state_dict(old)
    start = -(-old["position"] // 5) * 5
    assert np.array_equal(other_t.next_batch()[0][0].numpy(), arrays[1][start : start + 5])


def test_shuffled_loader_keeps_one_int32_per_window_and_no_copy_of_the_tokens(tmp_path):
    pattern, _ = make_shards(tmp_path, [5000, 3000])
    loader = DataLoader(pattern, 4, 16)
    loader.next_batch()
    n = (read_header(loader.files[loader.file]) - 1) // 16
    assert loader.order.dtype == np.int32 and loader.order.shape == (n,)
    base = loader.windows
    while not isinstance(base, np.memmap):  # the windows are a view of the memmapped file
        assert base is not None, "the loader's windows are not a view of the shard's memmap"
        base = base.base
    assert not loader.windows.flags.writeable


def test_loader_errors(tmp_path):
    pattern, _ = make_shards(tmp_path, [500, 60])
    with pytest.raises(
        ValueError, match=r"t_train_000002.bin: 60 tokens is too small.*2\*16\*2\+1"
    ):
        DataLoader(pattern, 2, 16, rank=0, world_size=2)
    with pytest.raises(FileNotFoundError, match="no shard files match"):
        DataLoader(str(tmp_path / "nothing_*.bin"), 2, 4)
    with pytest.raises(ValueError, match="rank"):
        DataLoader(pattern, 2, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="B must be a positive int"):
        DataLoader(pattern, 0, 4)
    loader = DataLoader(pattern, 2, 4)
    state = loader.state_dict()
    other = tmp_path / "other"
    other.mkdir()
    make_shards(other, [500, 60])
    (other / "t_train_000001.bin").rename(other / "u_train_000001.bin")
    moved = DataLoader(sorted(str(p) for p in other.glob("*.bin")), 2, 4)
    with pytest.raises(ValueError, match="was taken in shard t_train_000001.bin"):
        moved.load_state_dict(state)
    # a corrupt shard is reported when the loader opens it
    (tmp_path / "t_train_000002.bin").write_bytes(shard_bytes([EOT] * 59 + [60000]))
    loader = DataLoader(pattern, 2, 4)
    with pytest.raises(ShardError, match="t_train_000002.bin: token id 60000"):
        for _ in range(100):
            loader.next_batch()


def test_val_budget_split_across_ranks(tmp_path):
    rng = np.random.default_rng(1)
    val = rng.integers(0, 50257, 1000, dtype=np.int64)
    write_shard(tmp_path / "v_val_000000.bin", val)
    pattern = str(tmp_path / "v_val_*.bin")
    B, T, W = 2, 8, 3  # 48 tokens per step
    for max_tokens, steps in ((200, 4), (10_485_760, 20), (48, 1)):  # clipped to 999 // 48 = 20
        per_rank = [list(iter_val_batches(pattern, B, T, r, W, max_tokens)) for r in range(W)]
        assert all(len(batches) == steps for batches in per_rank)
        got = [per_rank[r][s][0] for s in range(steps) for r in range(W)]
        assert np.array_equal(torch.cat([x.reshape(-1) for x in got]).numpy(), val[: steps * 48])
        for r in range(W):
            for s, (_, y) in enumerate(per_rank[r]):
                start = s * 48 + r * 16
                assert np.array_equal(y.reshape(-1).numpy(), val[start + 1 : start + 17])
    first, again = (list(iter_val_batches(pattern, B, T, 1, W, 200)) for _ in range(2))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    with pytest.raises(ValueError, match="hold at most 1000 tokens each, fewer than one valid"):
        list(iter_val_batches(pattern, 10, 100, 0, 1))
    with pytest.raises(ValueError, match=r"^val_tokens=23 is less than one validation step .*"
                       r"= 24 tokens: pass --val_tokens=24 or more$"):  # fmt: skip
        list(iter_val_batches(pattern, B, T, 0, W, max_tokens=23))
    # a pass smaller than one micro-batch of 4 rows: 50 // (8 * 3) = 2 rows a batch, one step
    (x, _), *rest = iter_val_batches(pattern, 4, T, 0, W, max_tokens=50)
    assert x.shape == (2, T) and not rest and torch.equal(x.reshape(-1), torch.from_numpy(val[:16]))


def test_val_spans_several_shards(tmp_path):
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 50257, 100), rng.integers(0, 50257, 70)
    write_shard(tmp_path / "v_val_000000.bin", a)
    write_shard(tmp_path / "v_val_000001.bin", b)
    xs = [x.reshape(-1).numpy() for x, _ in iter_val_batches(str(tmp_path / "*.bin"), 1, 30)]
    # 99 // 30 = 3 steps in the first shard, 69 // 30 = 2 in the second
    assert len(xs) == 5
    assert np.array_equal(np.concatenate(xs), np.concatenate([a[:90], b[:60]]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loader_cuda_matches_cpu(tmp_path):
    pattern, _ = make_shards(tmp_path, [5000, 3000])
    cpu = DataLoader(pattern, 4, 64, rank=1, world_size=2)
    gpu = DataLoader(pattern, 4, 64, rank=1, world_size=2, device="cuda")
    batches = [gpu.next_batch() for _ in range(40)]  # held while later copies reuse pinned buffers
    for xg, yg in batches:
        x, y = cpu.next_batch()
        assert xg.is_cuda and xg.dtype == torch.int64
        assert torch.equal(xg.cpu(), x) and torch.equal(yg.cpu(), y)
    val = list(iter_val_batches(pattern, 4, 64, 0, 2, 4096, device="cuda"))
    ref = list(iter_val_batches(pattern, 4, 64, 0, 2, 4096))
    assert len(val) == len(ref) and all(
        torch.equal(g[0].cpu(), c[0]) for g, c in zip(val, ref, strict=True)
    )


# ---------------------------------------------------------------- datasets


def test_embedded_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(data.embedded, "CACHE_DIR", tmp_path)
    train, val = resolve_dataset("embedded")
    folder = data.embedded.embedded_dir()
    assert folder.parent == tmp_path and Path(train).parent == folder
    assert not [p for p in tmp_path.iterdir() if p != folder]  # no temp folder left
    assert read_header(folder / "embedded_train_000001.bin") == 1_804_880  # data/embedded/README
    assert read_header(folder / "embedded_val_000000.bin") == 151_001
    tokens = read_shard(folder / "embedded_train_000001.bin")
    assert tokens[0] == EOT
    assert get_tokenizer().decode(tokens[1:50].tolist()).startswith("Anarchism\n\n")
    loader = DataLoader(train, 4, 64)
    for _ in range(3):
        x, y = loader.next_batch()
        assert x.shape == (4, 64) and int(x.max()) < 50257 and torch.equal(x[:, 1:], y[:, :-1])
    assert len(list(iter_val_batches(val, 4, 64, max_tokens=4096))) == 16

    def no_prepare(*a, **k):
        raise AssertionError("prepared twice")

    monkeypatch.setattr(data.embedded, "prepare", no_prepare)
    assert resolve_dataset("embedded") == (train, val)


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "no manifest"])
def test_embedded_cache_heals_itself(tmp_path, monkeypatch, capsys, damage):
    """A damaged embedded cache (a shard cut short or changed in place, or a folder without its
    manifest) is found at the next use, said in one line naming it, set aside and rebuilt."""
    monkeypatch.setattr(data.embedded, "CACHE_DIR", tmp_path)
    folder = data.embedded.prepare_embedded()
    shard = folder / "embedded_val_000000.bin"
    good = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(good[: len(good) // 2])
    elif damage == "overwritten":
        shard.write_bytes(good[:2000] + bytes(100) + good[2100:])  # same size, header intact
    else:
        (folder / data.embedded.MANIFEST).unlink()
    capsys.readouterr()
    assert data.embedded.prepare_embedded() == folder
    said = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert len(said) == 1 and str(folder) in said[0]
    assert shard.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # nothing left aside


def test_a_damaged_shard_names_the_command_that_rebuilds_it(tmp_path):
    path = tmp_path / "fineweb_train_000001.bin"
    write_shard(path, np.array([EOT, 1, 2, 3]))
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ShardError) as e:
        read_shard(path)
    msg = str(e.value)
    assert str(path) in msg and "python -m data.fineweb" in msg and "\n" not in msg


def test_embedded_concurrent_prepare_loses_rename_race(tmp_path, monkeypatch):
    monkeypatch.setattr(data.embedded, "CACHE_DIR", tmp_path)
    final = data.embedded.embedded_dir()
    real_prepare = data.embedded.prepare

    def other_process_wins(docs, out_dir, name, **kw):
        paths = real_prepare(docs, out_dir, name, **kw)
        shutil.copytree(out_dir, final)  # another rank finished first
        return paths

    monkeypatch.setattr(data.embedded, "prepare", other_process_wins)
    assert data.embedded.prepare_embedded() == final
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_resolve_dataset_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither 'embedded' nor a folder"):
        resolve_dataset(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError) as err:  # llm.c's glob of train shards: name the folder
        resolve_dataset(str(tmp_path / "fineweb_train_*.bin"))
    assert f"; pass the folder, --dataset={str(tmp_path)!r}: " in str(err.value)
    write_shard(tmp_path / "d_train_000001.bin", np.array([EOT, 1]))
    with pytest.raises(FileNotFoundError, match="no val shards"):
        resolve_dataset(str(tmp_path))
    write_shard(tmp_path / "d_val_000000.bin", np.array([EOT, 2]))
    train, val = resolve_dataset(tmp_path)
    assert Path(train).name == "*_train_*.bin" and Path(val).name == "*_val_*.bin"
    assert os.path.samefile(Path(train).parent, tmp_path)
