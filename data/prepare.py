"""The shared preparation pipeline: documents -> GPT-2 tokens -> llm.c shards.

    documents (str iterator) -> process pool: [EOT] + encode_ordinary(doc) as uint16
                             -> packed into shards of `shard_size` tokens, val shards first

Shards are numbered globally, validation first (`{name}_val_000000.bin`, then
`{name}_train_000001.bin`, ...); a document that does not fit the current shard continues in the
next. Validation is either a separate document stream (`val_docs`) or the first whole documents of
the main stream until they hold >= `val_tokens` tokens.

Resumable: after each shard is renamed into place, `{name}_prepare.json` records where the document
stream stood (document index, tokens already written of that document). A rerun with the same
settings skips the finished shards without tokenising their documents again; the input stream must
yield the same documents in the same order (files and HF streaming splits do). A run stopped by its
input (a DataError: a bad file, too few documents) removes the shards it wrote and puts the state
back as it found it, so that the rerun starts afresh rather than resuming into the same failure.

Local inputs (all may be .xz or .gz compressed):
- text: WikiExtractor format when the first non-empty line starts with `<doc `; otherwise documents
  are separated by lines reading `<|endoftext|>` (TinyStories), and a file without one is one doc.
- jsonl: one JSON object per line, the document in its "text" field; empty documents are skipped.
"""

import gzip
import itertools
import json
import lzma
import multiprocessing
import os
import zlib
from pathlib import Path

import numpy as np

from data.shards import DataError, read_header, write_shard
from data.tokenizer import EOT, get_tokenizer
from gpt2_fused.training import cli
from gpt2_fused.training.errors import UsageError
from gpt2_fused.training.jsonl import iter_jsonl

# Prepared datasets and downloads go to data/cache/ in the clone, or to $GPT2_FUSED_CACHE (a bigger
# disk, a shared folder; as HF_DATASETS_CACHE moves `datasets`' cache), never beside installed code.
CACHE_ENV = "GPT2_FUSED_CACHE"
CACHE_DIR = Path(os.environ.get(CACHE_ENV) or Path(__file__).resolve().parent / "cache")
CACHE_DIR = CACHE_DIR.expanduser()
SHARD_SIZE = 10**8  # tokens per shard (200 MB), as in llm.c and modded-nanogpt
LOCAL_VAL_TOKENS = 2**20  # default val size when it is cut from the head of local files
_SEPARATOR = "<|endoftext|>"


class HubError(ConnectionError):
    """The Hugging Face hub cannot be reached (offline, a proxy, a firewall): the message says how
    to get there or what to prepare instead."""


# the prepare scripts' errors that are one line on the command line (errors.py)
CLI_ERRORS = {DataError: "data error", HubError: "network error"}


def open_text(path):
    """Open a UTF-8 text file for reading, decompressing .xz / .gz transparently."""
    path = str(path)
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_lines(path):
    """The lines of a text file (see open_text); a file that is not UTF-8 text (a binary file) or
    does not decompress raises DataError naming it."""
    try:
        with open_text(path) as f:
            yield from f
    except UnicodeDecodeError as e:
        byte = f"0x{e.object[e.start]:02x}"
        raise DataError(f"{path}: not UTF-8 text ({e.reason} {byte}); a binary file?") from None
    except (EOFError, lzma.LZMAError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: cannot be decompressed ({e}); truncated or corrupt?") from None


def _wiki_docs(lines, path):
    """WikiExtractor articles: `<doc ...>`, title line, body, `</doc>`; title-only stubs skipped."""
    body = None
    for lineno, line in enumerate(lines, 1):
        if line.startswith("<doc ") or line.startswith("<doc>"):
            if body is not None:
                raise DataError(f"{path}:{lineno}: <doc> opened inside another <doc>")
            body = []
        elif line.startswith("</doc>"):
            if body is None:
                raise DataError(f"{path}:{lineno}: </doc> without an opening <doc>")
            text = "".join(body).strip()
            if "\n" in text and text.split("\n", 1)[1].strip():  # more than the title line
                yield text
            body = None
        elif body is not None:
            body.append(line)
    if body is not None:
        raise DataError(f"{path}: ends inside a <doc> (truncated file?)")


def iter_text_docs(path):
    """Documents of a text file: WikiExtractor articles or `<|endoftext|>`-separated text."""
    lines = read_lines(path)
    head = list(itertools.islice(lines, 64))  # enough to find the first non-empty line
    lines = itertools.chain(head, lines)
    first = next((line for line in head if line.strip()), "")
    if first.startswith("<doc"):
        yield from _wiki_docs(lines, path)
        return
    doc = []
    for line in lines:
        if line.strip() == _SEPARATOR:
            text = "".join(doc).strip()
            if text:
                yield text
            doc = []
        else:
            doc.append(line)
    text = "".join(doc).strip()
    if text:
        yield text


def iter_jsonl_docs(path, key="text"):
    """The non-empty `key` fields of a JSON-lines file (see open_text)."""
    try:
        for lineno, row in iter_jsonl(path, lines=read_lines(path)):
            if not isinstance(row, dict) or key not in row:
                raise DataError(f"{path}:{lineno}: expected an object with a {key!r} field")
            text = row[key]
            if text and text.strip():
                yield text
    except DataError:
        raise
    except ValueError as e:  # a line that is not JSON, which iter_jsonl names
        raise DataError(str(e)) from None


def iter_file_docs(paths, fmt):
    """Documents of several files in order; fmt is "text", "jsonl" or "auto" (by file name)."""
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"input file not found: {path}")
        is_jsonl = ".jsonl" in Path(path).name if fmt == "auto" else fmt == "jsonl"
        yield from iter_jsonl_docs(path) if is_jsonl else iter_text_docs(path)


def tokenize(text):
    """[EOT] + GPT-2 tokens of `text` as uint16 (all ids < 50257 < 2**16)."""
    ids = get_tokenizer().encode_ordinary(text)
    out = np.empty(len(ids) + 1, dtype=np.uint16)
    out[0] = EOT
    out[1:] = ids
    return out


def _tokenize_tagged(item):
    tag, text = item
    return tag, tokenize(text)


def _state_path(out_dir, name):
    return Path(out_dir) / f"{name}_prepare.json"


def _save_state(out_dir, name, state):
    path = _state_path(out_dir, name)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def _load_records(out_dir, name, settings):
    """Records of the finished shards a previous run left, up to the first missing/damaged one."""
    path = _state_path(out_dir, name)
    if not path.exists():
        return [], False
    state = json.loads(path.read_text())
    if state.get("settings") != settings:
        raise DataError(
            f"{out_dir} holds {name} shards prepared with other settings:\n"
            f"  then: {state.get('settings')}\n  now:  {settings}\n"
            "use another --out-dir (or delete that one) to prepare with the new settings"
        )
    records = []
    for rec in state["shards"]:
        try:
            intact = read_header(Path(out_dir) / rec["file"]) == rec["tokens"]
        except (OSError, ValueError):
            intact = False
        if not intact:
            return records, False
        records.append(rec)
    return records, state.get("complete", False)


def prepare(
    docs,
    out_dir,
    name,
    *,
    val_docs=None,
    val_tokens=None,
    shard_size=SHARD_SIZE,
    workers=None,
    settings=None,
    progress=True,
):
    """Tokenise `docs` (and `val_docs`) into shards in `out_dir`; return all shard paths, val first.

    val_docs: a separate validation document stream, or None to cut validation from the head of
    `docs` (whole documents until >= val_tokens tokens). workers: tokeniser processes (default:
    cores - 1; <= 1 tokenises in this process; a pool needs the caller's `if __name__ ==
    "__main__":` guard). settings: extra JSON-able values (e.g. the input files) that a resumed run
    must match.
    """
    out_dir = Path(out_dir)
    if shard_size < 1:
        raise DataError(f"shard_size must be >= 1, got {shard_size}")
    if val_docs is None and (val_tokens is None or val_tokens < 1):
        raise DataError("give val_docs, or val_tokens >= 1 to cut validation from the documents")
    settings = json.loads(
        json.dumps(
            {
                "name": name,
                "shard_size": shard_size,
                "val_tokens": None if val_docs is not None else val_tokens,
                **(settings or {}),
            }
        )
    )  # JSON round trip so the comparison with a saved state sees the same types
    made = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    records, complete = _load_records(out_dir, name, settings)
    if complete:
        print(f"{name}: all {len(records)} shards already prepared in {out_dir}")
        return [out_dir / r["file"] for r in records]
    if records:
        print(f"{name}: resuming after {len(records)} finished shards in {out_dir}")

    finished = list(records)
    try:
        sizes = dict(val_tokens=val_tokens, shard_size=shard_size, workers=workers)
        _pack(docs, val_docs, out_dir, name, records, settings, progress=progress, **sizes)
    except DataError:  # the input's fault: a rerun must start where this one did, not resume it
        _undo(out_dir, name, records[len(finished) :], finished, settings, made)
        raise
    return [out_dir / r["file"] for r in records]


def _undo(out_dir, name, written, finished, settings, made):
    """Remove the shards a failed call wrote and put back the state it found (none: no state
    file, and no out_dir when the call made it)."""
    for rec in written:
        (out_dir / rec["file"]).unlink(missing_ok=True)
    if finished:
        _save_state(out_dir, name, dict(settings=settings, shards=finished, complete=False))
    else:
        _state_path(out_dir, name).unlink(missing_ok=True)
        if made and not any(out_dir.iterdir()):
            out_dir.rmdir()


def _pack(
    docs, val_docs, out_dir, name, records, settings, *, val_tokens, shard_size, workers, progress
):
    """Tokenise the documents not yet in `records`' shards into more shards, appending each to
    `records` and to the state file as it is written (see prepare)."""
    get_tokenizer()  # fail early on damaged BPE files
    if val_docs is None:
        stream = (("auto", text) for text in docs)
    else:
        stream = itertools.chain(
            (("val", text) for text in val_docs), (("train", text) for text in docs)
        )
    doc_index, drop = (records[-1]["next_doc"], records[-1]["next_offset"]) if records else (0, 0)
    stream = itertools.islice(stream, doc_index, None)
    phase = records[-1]["split"] if records else "val"
    val_count = sum(r["tokens"] for r in records if r["split"] == "val")
    buf = np.empty(shard_size, dtype=np.uint16)
    fill = 0

    def flush(split, next_doc, next_offset):
        nonlocal fill
        kind = "val" if split == "val" else "train"
        fname = f"{name}_{kind}_{len(records):06d}.bin"
        write_shard(out_dir / fname, buf[:fill])
        records.append(
            dict(file=fname, split=kind, tokens=fill, next_doc=next_doc, next_offset=next_offset)
        )
        _save_state(out_dir, name, dict(settings=settings, shards=records, complete=False))
        fill = 0

    bar = _progress_bar(name, progress)
    # one core stays with this process, which reads, decompresses and packs
    n_workers = max(1, (os.cpu_count() or 2) - 1) if workers is None else workers
    # spawn, not fork: forking a process that already runs threads (BLAS, HF streaming) can
    # deadlock. Workers re-import __main__, so a calling script needs the usual `if __name__ ==
    # "__main__":` guard; that import is cheap for `python -m data.fineweb`, ~seconds for a script
    # that imports torch.
    pool = multiprocessing.get_context("spawn").Pool(n_workers) if n_workers > 1 else None
    try:
        results = (
            pool.imap(_tokenize_tagged, stream, chunksize=16)
            if pool
            else map(_tokenize_tagged, stream)
        )
        for tag, toks in results:
            offset, drop = drop, 0  # tokens of this document already in earlier shards
            if offset:
                split = phase  # a resumed document continues in the split it started in
            elif tag == "auto":
                split = "val" if phase == "val" and val_count < val_tokens else "train"
            else:
                split = tag
            if split != phase:  # validation ends on a document boundary, in its own shard
                if fill:
                    flush(phase, doc_index, 0)
                if val_count == 0:
                    raise DataError(f"{name}: the validation documents are empty")
                phase = split
            pos = offset
            while pos < len(toks):
                n = min(shard_size - fill, len(toks) - pos)
                buf[fill : fill + n] = toks[pos : pos + n]
                fill += n
                pos += n
                if split == "val":
                    val_count += n
                if fill == shard_size:
                    at_end = pos == len(toks)
                    flush(split, doc_index + at_end, 0 if at_end else pos)
                    bar.set_postfix(shard=len(records))
            bar.update(len(toks) - offset)
            doc_index += 1
    finally:
        if pool is not None:
            pool.terminate()
        bar.close()
    if fill:
        flush(phase, doc_index, 0)
    if phase == "val":
        raise DataError(
            f"{name}: no training documents left after the validation split ({val_count} tokens);"
            " give more input, a separate validation file, or a smaller validation size"
        )
    _save_state(out_dir, name, dict(settings=settings, shards=records, complete=True))
    total = sum(r["tokens"] for r in records)
    print(
        f"{name}: {len(records)} shards, {val_count:,} val + {total - val_count:,} train tokens "
        f"in {out_dir}; train on them with --dataset={out_dir}"
    )


def _progress_bar(name, enabled):
    from tqdm import tqdm

    return tqdm(desc=name, unit="tok", unit_scale=True, disable=not enabled, mininterval=1.0)


# ---- command line, shared by data.fineweb and data.tinystories ----


def check_hub(repo, command):
    """Raise HubError at once when dataset `repo` on the Hugging Face hub cannot be reached (one
    request, through the proxies the environment names, as `datasets`' own go), instead of
    `datasets`' retries and traceback. command: the script, for the message's --from-text."""
    from huggingface_hub import HfApi, constants

    local = f"or prepare local text: python -m {command} --from-text FILES"
    if constants.HF_HUB_OFFLINE:
        raise HubError(
            f"{repo} is streamed from the Hugging Face hub, but HF_HUB_OFFLINE is set: unset it, "
            + local
        )
    try:
        HfApi().dataset_info(repo, timeout=10)
    except Exception as e:  # requests' or httpx's own errors, by huggingface_hub's version
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise HubError(
            f"cannot reach {repo} on the Hugging Face hub ({constants.ENDPOINT}; {reason}): it "
            "needs network (behind a proxy: HTTPS_PROXY=http://HOST:PORT; a mirror: "
            f"HF_ENDPOINT=URL), {local}"
        ) from e


def add_prepare_args(parser, default_name, out_dir):
    """Options every prepare script takes: local inputs, output place, shard size, workers.
    out_dir: where the shards go by default, as --help says it."""
    parser.add_argument("--from-text", nargs="+", metavar="FILE", help="local text files")
    parser.add_argument("--from-jsonl", nargs="+", metavar="FILE", help="local JSON-lines files")
    parser.add_argument(
        "--val-from",
        nargs="+",
        metavar="FILE",
        help="files tokenised into the val shard(s); .jsonl in the name means JSON lines",
    )
    parser.add_argument(
        "--val-tokens",
        type=cli.positive_int,
        help="without --val-from: validation = the first whole documents reaching this many tokens",
    )
    parser.add_argument("--out-dir", type=Path, help=f"where the shards go (default: {out_dir})")
    parser.add_argument("--name", default=default_name, help="shard file name prefix")
    parser.add_argument(
        "--shard-size", type=cli.positive_int, default=SHARD_SIZE, help="tokens per shard"
    )
    parser.add_argument("--workers", type=int, help="tokeniser processes (default: cores - 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_local(args, out_dir):
    """Prepare from the local files named on the command line; the caller handles the hub case."""
    if args.from_text and args.from_jsonl:
        raise UsageError("give --from-text or --from-jsonl, not both")
    paths, fmt = (args.from_text, "text") if args.from_text else (args.from_jsonl, "jsonl")
    for p in list(paths) + list(args.val_from or []):
        if not Path(p).is_file():
            what = "a folder, not a file" if Path(p).is_dir() else "not found"
            raise UsageError(f"input file {what}: {p}")
    val_docs = iter_file_docs(args.val_from, "auto") if args.val_from else None
    val_tokens = None if args.val_from else (args.val_tokens or LOCAL_VAL_TOKENS)
    settings = {
        "inputs": [str(Path(p).resolve()) for p in paths],
        "val_from": [str(Path(p).resolve()) for p in args.val_from or []],
    }
    return prepare(
        iter_file_docs(paths, fmt),
        out_dir,
        args.name,
        val_docs=val_docs,
        val_tokens=val_tokens,
        shard_size=args.shard_size,
        workers=args.workers,
        settings=settings,
        progress=not args.no_progress,
    )
