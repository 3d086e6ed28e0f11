"""HellaSwag (validation split): download, parsing, and the evaluation llm.c reports for GPT-2.

    python -m data.hellaswag download               # -> data/cache/hellaswag/ ($GPT2_FUSED_CACHE)

`evaluate(model, ...)` scores a model; eval_hellaswag.py (beside train.py) scores a checkpoint or
an HF GPT-2 directory from the command line, also under torchrun.

Each example is a context and 4 candidate endings, one of them right. As llm.c and the original
GPT-2 evaluation do, every candidate is the context tokens followed by the tokens of " " + ending,
and is scored by its cross-entropy over the ending tokens only (the context is given, not scored):

    row_i   = enc(ctx) + enc(" " + ending_i)          i = 0..3: one (4, T) batch, padded at the end
    sum_i   = sum over ending tokens t of -log p(row_i[t] | row_i[:t])      (nats)
    mean_i  = sum_i / number of ending tokens
    acc_norm: argmin_i mean_i == label               acc: argmin_i sum_i == label

acc_norm is the number quoted for GPT-2; acc favours short endings. Padding follows every real
token, so causal attention keeps it out of the scored positions. A row longer than the model's
block_size keeps its last block_size tokens (context cut from the left), so a model with a short
block_size is scored on truncated contexts. Examples are strided over ranks (rank r takes those
with index % world_size == r) and the counts are summed with an all-reduce.
"""

import contextlib
import hashlib
import math
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from data.prepare import CACHE_DIR
from data.tokenizer import EOT, get_tokenizer
from gpt2_fused.training import cli
from gpt2_fused.training.errors import run_main
from gpt2_fused.training.jsonl import iter_jsonl

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
VAL_EXAMPLES = 10042  # lines of hellaswag_val.jsonl, one example each
DEFAULT_DIR = CACHE_DIR / "hellaswag"
DEFAULT_PATH = DEFAULT_DIR / "hellaswag_val.jsonl"
# No sha256 is pinned: the file could not be fetched where this module was written (no network),
# and a checksum nobody verified is worse than none. A download is checked instead against its
# Content-Length, the example count above and a parse of every line; its sha256 is printed so a
# user can compare it or pin it.

N_ENDINGS = 4


class Example(NamedTuple):
    ctx: list  # context token ids
    endings: list  # N_ENDINGS lists of token ids, each for " " + ending
    label: int  # index of the right ending
    line: int  # line number in the file, for error messages
    max_id: int  # largest token id in the example, checked against the model's vocab


# ----------------------------------------------------------------------------------------------
# parsing


def _check_example(ex, where):
    """A parsed JSON line -> (ctx, endings, label), or ValueError naming file:line."""
    if not isinstance(ex, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(ex).__name__}")
    missing = [k for k in ("ctx", "endings", "label") if k not in ex]
    if missing:
        hint = (
            " (the test split has no labels: use the validation split)"
            if missing == ["label"]
            else ""
        )
        raise ValueError(f"{where}: missing field(s) {missing}{hint}")
    ctx, endings, label = ex["ctx"], ex["endings"], ex["label"]
    if not isinstance(ctx, str):
        raise ValueError(f"{where}: 'ctx' must be a string, got {type(ctx).__name__}")
    if (
        not isinstance(endings, list)
        or len(endings) != N_ENDINGS
        or not all(isinstance(e, str) for e in endings)
    ):
        got = f"{len(endings)} items" if isinstance(endings, list) else type(endings).__name__
        raise ValueError(f"{where}: 'endings' must be a list of {N_ENDINGS} strings, got {got}")
    if isinstance(label, str) and label.isdigit():  # HF dataset exports store "0".."3"
        label = int(label)
    if type(label) is not int or not 0 <= label < N_ENDINGS:  # type(): a bool is not a label
        raise ValueError(
            f"{where}: 'label' must be an integer in 0..{N_ENDINGS - 1}, got {label!r}"
        )
    return ctx, endings, label


def load_examples(path):
    """Read a HellaSwag jsonl file -> list of (ctx, endings, label, line) tuples.

    Raises FileNotFoundError for a missing file and ValueError naming the file and line for
    anything malformed: bad UTF-8 or JSON, missing fields, not 4 string endings, a label
    outside 0..3. Blank lines are skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"HellaSwag file {path} not found; get it with: python -m data.hellaswag download"
        )
    out = [(*_check_example(ex, f"{path}:{n}"), n) for n, ex in iter_jsonl(path)]
    if not out:
        raise ValueError(f"{path}: no examples (empty file)")
    return out


# (path, mtime_ns, size) -> list of Example: training evaluates the same file every eval step
_TOKENIZED = {}


def load_tokenized(path):
    """The examples of path, tokenised once per process (and again if the file changes)."""
    path = Path(path)
    if not path.is_file():  # load_examples words the error
        return load_examples(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _TOKENIZED:
        enc = get_tokenizer()
        examples = []
        for ctx, endings, label, line in load_examples(path):
            # encode_ordinary: a literal "<|endoftext|>" in the text is text, never a control token
            ctx_ids = enc.encode_ordinary(ctx) or [EOT]  # an empty context still predicts token 1
            end_ids = [enc.encode_ordinary(" " + e) for e in endings]
            max_id = max(max(ids) for ids in [ctx_ids, *end_ids])
            examples.append(Example(ctx_ids, end_ids, label, line, max_id))
        _TOKENIZED.clear()  # keep one file's tokens, not one per version of it
        _TOKENIZED[key] = examples
    return _TOKENIZED[key]


# ----------------------------------------------------------------------------------------------
# scoring


def build_batch(ctx, endings, block_size):
    """Token ids of one example -> tokens (4, T) int64 and mask (4, T) bool (True on ending
    tokens), on CPU. Rows are padded with 0 at the end; a row longer than block_size keeps its
    last block_size tokens."""
    rows, masks = [], []
    for end in endings:
        row, mask = ctx + end, [False] * len(ctx) + [True] * len(end)
        cut = max(0, len(row) - block_size)
        rows.append(row[cut:])
        masks.append(mask[cut:])
    T = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([m + [False] * (T - len(m)) for m in masks], dtype=torch.bool)
    return tokens, mask


def ending_losses(logits, tokens, mask):
    """logits (N, T, V), tokens (N, T), mask (N, T) bool -> (sum_loss, mean_loss), each (N,)
    fp32 nats, over the tokens where mask is True. Token 0 of a row has no prediction and is
    never scored."""
    N, T, V = logits.shape
    losses = F.cross_entropy(
        logits[:, :-1].reshape(-1, V).float(), tokens[:, 1:].reshape(-1), reduction="none"
    ).view(N, T - 1)
    scored = mask[:, 1:]
    sum_loss = (losses * scored).sum(dim=1)
    return sum_loss, sum_loss / scored.sum(dim=1)


def _unwrap(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


@torch.no_grad()
def evaluate(
    model,
    path,
    device,
    rank=0,
    world_size=1,
    limit=None,
    autocast_dtype=None,
    *,
    progress=False,
):
    """HellaSwag accuracy of model on the jsonl at path -> {"acc_norm", "acc", "n"}.

    model: a GPT (or torch.compile / DDP wrapping one), already on device; it needs
    `model.config.block_size / vocab_size` and `model(idx, all_positions=True)` -> logits
    (B, T, vocab_size). limit: evaluate only the first `limit` examples of the file (the same
    ones for any world_size). Rank r scores examples r, r + world_size, ...; when a
    torch.distributed process group is initialised and world_size > 1 the counts are
    all-reduced (every rank must call this), else the result covers this rank's share only.
    autocast_dtype: e.g. torch.bfloat16 to run under autocast; None runs in the weights' dtype.
    progress: a tqdm bar over this rank's examples. The model's train/eval mode is restored.
    """
    device = torch.device(device)
    if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() != world_size:
        raise ValueError(
            f"world_size={world_size} but the process group has {dist.get_world_size()}"
        )
    cfg = _unwrap(model).config
    if cfg.block_size < 2:
        raise ValueError(f"block_size={cfg.block_size}: need >= 2 tokens to score an ending")

    examples = load_tokenized(path)[:limit]
    mine = examples[rank::world_size]
    # all examples, not this rank's: every rank must fail alike, or the others hang in all_reduce
    worst = max(examples, key=lambda ex: ex.max_id)
    if worst.max_id >= cfg.vocab_size:
        raise ValueError(
            f"{path}:{worst.line}: token id {worst.max_id} >= the model's vocab_size="
            f"{cfg.vocab_size}; HellaSwag needs a model with the GPT-2 vocabulary"
        )
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    # correct by mean loss, correct by sum loss, examples; kept on device: no sync per example
    stats = torch.zeros(3, dtype=torch.long, device=device)
    stats[2] = len(mine)
    was_training = model.training
    model.eval()
    try:
        for ex in tqdm(mine, desc="hellaswag", unit="ex", disable=not progress):
            tokens, mask = build_batch(ex.ctx, ex.endings, cfg.block_size)
            tokens, mask = tokens.to(device), mask.to(device)
            with autocast:
                logits = model(tokens, all_positions=True)  # (4, T, vocab_size) fp32
            sum_loss, mean_loss = ending_losses(logits, tokens, mask)
            stats[0] += mean_loss.argmin() == ex.label
            stats[1] += sum_loss.argmin() == ex.label
    finally:
        model.train(was_training)
    if distributed:
        dist.all_reduce(stats)
    correct_norm, correct, n = stats.tolist()
    return {
        "acc_norm": correct_norm / n if n else math.nan,
        "acc": correct / n if n else math.nan,
        "n": n,
    }


# ----------------------------------------------------------------------------------------------
# download


def _open_url(url):
    """The HTTP response for url (a file-like object with .headers); tests replace this."""
    return urllib.request.urlopen(url, timeout=60)


def _check_download(path):
    n = len(load_examples(path))  # every line parses as an example
    if n != VAL_EXAMPLES:
        raise ValueError(
            f"{path}: {n} examples, expected {VAL_EXAMPLES} (truncated, or not the val split?)"
        )


def download(out_dir=DEFAULT_DIR, url=URL):
    """Download the HellaSwag validation jsonl into out_dir (atomically) -> its path.

    A file already there that passes the checks is kept; a damaged one is replaced."""
    path = Path(out_dir) / "hellaswag_val.jsonl"
    if path.is_file():
        try:
            _check_download(path)
            print(f"{path} is already there ({VAL_EXAMPLES:,} examples)")
            return path
        except ValueError as e:
            print(f"{path} fails the checks ({e}); downloading it again")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    sha, got = hashlib.sha256(), 0
    try:
        try:
            resp = _open_url(url)
        except urllib.error.URLError as e:
            raise ConnectionError(f"cannot download {url}: {e.reason}") from e
        with resp, open(tmp, "wb") as f:
            total = resp.headers.get("Content-Length")
            total = int(total) if total else None
            with tqdm(total=total, unit="B", unit_scale=True, desc=path.name) as bar:
                while chunk := resp.read(1 << 16):
                    f.write(chunk)
                    sha.update(chunk)
                    got += len(chunk)
                    bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
        if total is not None and got != total:
            raise ValueError(f"download of {url} is truncated: {got:,} of {total:,} bytes")
        _check_download(tmp)
        os.replace(tmp, path)  # only a complete, checked file ever has the real name
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {path}: {VAL_EXAMPLES:,} examples, {got:,} bytes, sha256 {sha.hexdigest()}")
    return path


# ----------------------------------------------------------------------------------------------
# command line


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help=f"download the validation split ({VAL_EXAMPLES:,} lines)")
    d.add_argument("--out-dir", default=str(DEFAULT_DIR), help="where the file goes")
    args = p.parse_args(argv)
    return download(args.out_dir)


if __name__ == "__main__":
    run_main(main, {FileNotFoundError: "error", ValueError: "error", ConnectionError: "error"})
