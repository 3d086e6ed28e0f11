"""data/hellaswag.py: parsing errors, scoring vs a brute-force loop, hand-built models, ranks,
the command line (also under torchrun) and the download, with a fake fetch (never the network)."""

import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
import urllib.error
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eval_hellaswag
from data import hellaswag as hs
from data.tokenizer import get_tokenizer
from gpt2_fused.training import model_io
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "hellaswag_sample.jsonl"
V = 50257


def fixture_records():
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tiny_gpt(seed=0, block_size=256, **kw):
    """A 2-layer GPT over the full GPT-2 vocab with large embeddings, so logits are peaky
    (std ~5) and the 4 candidates' losses are far apart, never near-ties."""
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, loss_impl="torch", **kw)
    model = GPT(cfg)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(50.0)
    return model.eval()


def brute_force(model, records, block_size):
    """Per example: (sum, mean) loss of each ending, each candidate run alone, unpadded."""
    enc = get_tokenizer()
    out = []
    for r in records:
        ctx = enc.encode(r["ctx"])
        sums, means = [], []
        for ending in r["endings"]:
            end = enc.encode(" " + ending)
            seq = (ctx + end)[-block_size:]
            idx = torch.tensor([seq])
            with torch.no_grad():
                logits = model(idx, all_positions=True)[0]  # (T, V)
            losses = F.cross_entropy(logits[:-1], idx[0, 1:], reduction="none")
            scored = losses[-min(len(end), len(seq) - 1) :]  # the ending's tokens that have a past
            sums.append(scored.sum().item())
            means.append(scored.mean().item())
        out.append((sums, means))
    return out


def accuracies(records, losses):
    """(acc_norm, acc) from brute-force losses."""
    argmin = lambda xs: min(range(len(xs)), key=xs.__getitem__)
    norm = sum(argmin(m) == r["label"] for r, (_, m) in zip(records, losses, strict=True))
    plain = sum(argmin(s) == r["label"] for r, (s, _) in zip(records, losses, strict=True))
    return norm / len(records), plain / len(records)


class ScriptedLM(nn.Module):
    """A hand-built LM: logits 0 everywhere, except that a row starting with one of the token
    sequences in `boosts` gets logit `boost` on each next token of that sequence. Such a token
    costs log(V - 1 + e^b) - b nats; any other costs log V."""

    def __init__(self, boosts, block_size=1024):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=V, block_size=block_size)
        self.boosts = boosts  # {tuple of token ids: boost}

    def forward(self, idx, all_positions=False):
        assert all_positions
        B, T = idx.shape
        logits = torch.zeros(B, T, V)
        for b, row in enumerate(idx.tolist()):
            for seq, boost in self.boosts.items():
                if tuple(row[: len(seq)]) == seq:
                    logits[b, torch.arange(len(seq) - 1), torch.tensor(seq[1:])] = boost
        return logits


def boost_for(loss):
    """The boost that makes a token cost `loss` nats under ScriptedLM."""
    return math.log((V - 1) / math.expm1(loss))


def row_tokens(record, i):
    enc = get_tokenizer()
    return tuple(enc.encode(record["ctx"]) + enc.encode(" " + record["endings"][i]))


# ---------------------------------------------------------------- parsing


def test_fixture_parses():
    examples = hs.load_examples(FIXTURE)
    records = fixture_records()
    assert len(examples) == len(records) == 6
    for (ctx, endings, label, line), r, n in zip(examples, records, range(1, 7), strict=True):
        assert (ctx, endings, label, line) == (r["ctx"], r["endings"], r["label"], n)
    assert sorted({r["label"] for r in records}) == [0, 1, 2, 3]


GOOD = fixture_records()[0]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"ctx": "a", "endings": ["x", "y"', "not a JSON line"),
        ('["not", "an", "object"]', "expected a JSON object, got list"),
        (
            json.dumps({k: v for k, v in GOOD.items() if k != "ctx"}),
            r"missing field\(s\) \['ctx'\]",
        ),
        (json.dumps({k: v for k, v in GOOD.items() if k != "label"}), "test split has no labels"),
        (json.dumps({**GOOD, "endings": GOOD["endings"][:3]}), "list of 4 strings, got 3 items"),
        (json.dumps({**GOOD, "endings": [*GOOD["endings"][:3], 7]}), "list of 4 strings"),
        (json.dumps({**GOOD, "endings": "one ending"}), "list of 4 strings, got str"),
        (json.dumps({**GOOD, "ctx": None}), "'ctx' must be a string"),
        (json.dumps({**GOOD, "label": 4}), "'label' must be an integer in 0..3, got 4"),
        (json.dumps({**GOOD, "label": -1}), "got -1"),
        (json.dumps({**GOOD, "label": True}), "got True"),
        (json.dumps({**GOOD, "label": 1.0}), "got 1.0"),
    ],
    ids=["json", "list", "no-ctx", "no-label", "3-endings", "int-ending", "str-endings",
         "null-ctx", "label-4", "label-neg", "label-bool", "label-float"],
)  # fmt: skip
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")  # blank line 2 is skipped
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + message):
        hs.load_examples(path)


def test_not_utf8_empty_missing_and_string_label(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"ctx": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not UTF-8")):
        hs.load_examples(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no examples"):
        hs.load_examples(empty)
    with pytest.raises(FileNotFoundError, match="python -m data.hellaswag download"):
        hs.load_examples(tmp_path / "nope.jsonl")
    # HF dataset exports store the label as a string
    path = write_jsonl(tmp_path / "str_label.jsonl", [{**GOOD, "label": "3"}])
    assert hs.load_examples(path)[0][2] == 3


# ---------------------------------------------------------------- scoring


def test_build_batch_pads_masks_and_crops():
    ctx, endings = [5, 6, 7], [[8], [9, 10], [11, 12, 13], [14]]
    tokens, mask = hs.build_batch(ctx, endings, block_size=64)
    assert tokens.tolist() == [
        [5, 6, 7, 8, 0, 0],
        [5, 6, 7, 9, 10, 0],
        [5, 6, 7, 11, 12, 13],
        [5, 6, 7, 14, 0, 0],
    ]
    assert mask.int().tolist() == [
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 0, 0],
    ]
    tokens, mask = hs.build_batch(ctx, endings, block_size=4)  # the context is cut from the left
    assert tokens.tolist() == [[5, 6, 7, 8], [6, 7, 9, 10], [7, 11, 12, 13], [5, 6, 7, 14]]
    assert mask.int().tolist() == [[0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]]


@pytest.mark.parametrize("block_size", [256, 24])  # 24 cuts most rows: contexts are cropped
def test_matches_brute_force_loop(block_size):
    model = tiny_gpt(block_size=block_size)
    records = fixture_records()
    ref = brute_force(model, records, block_size)
    for r, (sums, means), ex in zip(records, ref, hs.load_tokenized(FIXTURE), strict=True):
        tokens, mask = hs.build_batch(ex.ctx, ex.endings, block_size)
        assert tokens.size(1) <= block_size
        with torch.no_grad():
            sum_loss, mean_loss = hs.ending_losses(model(tokens, all_positions=True), tokens, mask)
        torch.testing.assert_close(sum_loss, torch.tensor(sums), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mean_loss, torch.tensor(means), rtol=1e-4, atol=1e-4)
        assert ex.label == r["label"]
    acc_norm, acc = accuracies(records, ref)
    res = hs.evaluate(model, FIXTURE, "cpu")
    assert res == {"acc_norm": pytest.approx(acc_norm), "acc": pytest.approx(acc), "n": 6}
    # the losses differ widely between candidates: the check above is not decided by noise
    assert min(max(m) - min(m) for _, m in ref) > 0.05


def test_picks_the_ending_a_scripted_model_prefers():
    records = fixture_records()
    # prefer the right ending in examples 0..3 and a wrong one in 4 and 5
    prefer = [r["label"] for r in records[:4]] + [(r["label"] + 1) % 4 for r in records[4:]]
    rows = [[row_tokens(r, i) for i in range(4)] for r in records]
    for cands in rows:  # a row must not be a prefix of another, or the script is ambiguous
        assert all(a == b or a[: len(b)] != b for a in cands for b in cands)
    model = ScriptedLM({rows[k][i]: 10.0 for k, i in enumerate(prefer)})
    res = hs.evaluate(model, FIXTURE, "cpu")
    assert res == {"acc_norm": pytest.approx(4 / 6), "acc": pytest.approx(4 / 6), "n": 6}
    model = ScriptedLM({rows[k][r["label"]]: 10.0 for k, r in enumerate(records)})
    assert hs.evaluate(model, FIXTURE, "cpu")["acc_norm"] == 1.0


def test_acc_norm_and_acc_differ_when_lengths_differ(tmp_path):
    rec = {
        **GOOD,
        "ctx": "A cat sits on a windowsill in the sun.",
        "endings": [
            "It watches the birds outside and slowly falls asleep as the afternoon goes by.",
            "It yawns.",
            "A truck full of bricks drives over the bridge.",
            "The ocean freezes solid.",
        ],
        "label": 0,
    }
    path = write_jsonl(tmp_path / "one.jsonl", [rec])
    n_end = [len(get_tokenizer().encode(" " + e)) for e in rec["endings"]]
    # the sums order the other way round from the means: 2 * 15 > 5 * 4 < log(V) * 5
    assert 2.0 * n_end[0] > 5.0 * n_end[1] < math.log(V) * min(n_end[2:])
    # ending 0: 2 nats a token (low mean, high sum); ending 1: 5 nats a token (short: low sum);
    # endings 2, 3: log V = 10.8 nats a token
    model = ScriptedLM({row_tokens(rec, 0): boost_for(2.0), row_tokens(rec, 1): boost_for(5.0)})
    ex = hs.load_tokenized(path)[0]
    tokens, mask = hs.build_batch(ex.ctx, ex.endings, 1024)
    sum_loss, mean_loss = hs.ending_losses(model(tokens, all_positions=True), tokens, mask)
    expected = torch.tensor([2.0, 5.0, math.log(V), math.log(V)])
    torch.testing.assert_close(mean_loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum_loss, expected * torch.tensor(n_end), rtol=1e-5, atol=1e-4)
    # acc_norm picks the long right ending (lowest mean), acc the short wrong one (lowest sum)
    assert hs.evaluate(model, path, "cpu") == {"acc_norm": 1.0, "acc": 0.0, "n": 1}


def test_ranks_limit_mode_and_errors():
    model = tiny_gpt()
    full = hs.evaluate(model, FIXTURE, "cpu")
    parts = [hs.evaluate(model, FIXTURE, "cpu", rank=r, world_size=4) for r in range(4)]
    assert [p["n"] for p in parts] == [2, 2, 1, 1]  # examples 0,4 | 1,5 | 2 | 3
    assert sum(p["acc_norm"] * p["n"] for p in parts) == pytest.approx(full["acc_norm"] * 6)
    assert sum(p["acc"] * p["n"] for p in parts) == pytest.approx(full["acc"] * 6)
    records = fixture_records()[:4]
    acc_norm, acc = accuracies(records, brute_force(model, records, 256))
    limited = hs.evaluate(model, FIXTURE, "cpu", limit=4)
    assert limited == {"acc_norm": pytest.approx(acc_norm), "acc": pytest.approx(acc), "n": 4}
    empty = hs.evaluate(model, FIXTURE, "cpu", rank=7, world_size=8)  # a rank with no example
    assert empty["n"] == 0 and math.isnan(empty["acc_norm"])

    model.train()
    hs.evaluate(model, FIXTURE, "cpu", limit=1)
    assert model.training  # mode restored
    with pytest.raises(ValueError, match="rank"):
        hs.evaluate(model, FIXTURE, "cpu", rank=2, world_size=2)
    with pytest.raises(ValueError, match="limit"):
        hs.evaluate(model, FIXTURE, "cpu", limit=0)
    with pytest.raises(ValueError, match="vocab_size=512"):
        hs.evaluate(tiny_gpt(vocab_size=512, padded_vocab_size=512), FIXTURE, "cpu")


def test_bfloat16_autocast_agrees_on_peaky_model():
    model = tiny_gpt()
    fp32 = hs.evaluate(model, FIXTURE, "cpu")
    bf16 = hs.evaluate(model, FIXTURE, "cpu", autocast_dtype=torch.bfloat16)
    assert bf16 == fp32


# ---------------------------------------------------------------- command line


def test_cli_eval_checkpoint_and_hf_dir(tmp_path, capsys):
    model = tiny_gpt()
    ckpt = {"model": model.state_dict(), "model_config": asdict(model.config), "step": 1}
    torch.save(ckpt, tmp_path / "ckpt_0000001.pt")
    expected = hs.evaluate(model, FIXTURE, "cpu")
    args = ["--data", str(FIXTURE), "--device", "cpu"]
    assert eval_hellaswag.main(["--ckpt", str(tmp_path), *args]) == expected
    out = capsys.readouterr().out
    assert f"hellaswag acc_norm {expected['acc_norm']:.4f} (" in out and "/6)" in out
    model_io.save_hf(model, tmp_path / "hf")
    assert eval_hellaswag.main(["--hf-dir", str(tmp_path / "hf"), *args, "--limit", "3"]) == (
        hs.evaluate(model, FIXTURE, "cpu", limit=3)
    )
    with pytest.raises(FileNotFoundError, match="download"):
        eval_hellaswag.main(["--ckpt", str(tmp_path), "--data", str(tmp_path / "none.jsonl")])


def test_cli_eval_under_torchrun_all_reduces(tmp_path):
    model = tiny_gpt()
    ckpt = {"model": model.state_dict(), "model_config": asdict(model.config), "step": 1}
    torch.save(ckpt, tmp_path / "ckpt_0000001.pt")
    expected = hs.evaluate(model, FIXTURE, "cpu")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "eval_hellaswag.py", "--ckpt", str(tmp_path), "--data", str(FIXTURE),
        "--device", "cpu",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    lines = [line for line in res.stdout.splitlines() if line.startswith("hellaswag acc_norm")]
    assert len(lines) == 1, out  # rank 0 alone prints, with the counts of both ranks
    assert f"acc_norm {expected['acc_norm']:.4f} ({round(expected['acc_norm'] * 6)}/6)" in lines[0]
    assert f"acc {expected['acc']:.4f} ({round(expected['acc'] * 6)}/6)" in lines[0]
    assert "x 2" in lines[0]


# ---------------------------------------------------------------- download (fake fetch)


class FakeResponse(io.BytesIO):
    def __init__(self, body, length=None):
        super().__init__(body)
        self.headers = {"Content-Length": str(len(body) if length is None else length)}


@pytest.fixture
def fake_fetch(monkeypatch):
    """Serve the fixture as the download; VAL_EXAMPLES set to its 6 examples."""
    body = FIXTURE.read_bytes()
    calls = []

    def open_url(url, body=body, length=None):
        calls.append(url)
        return FakeResponse(body, length)

    monkeypatch.setattr(hs, "VAL_EXAMPLES", 6)
    monkeypatch.setattr(hs, "_open_url", open_url)
    return SimpleNamespace(
        body=body, calls=calls, set=lambda f: monkeypatch.setattr(hs, "_open_url", f)
    )


def test_download_writes_checked_file_atomically(tmp_path, fake_fetch, capsys):
    out_dir = tmp_path / "hs"
    path = hs.download(out_dir)
    assert path == out_dir / "hellaswag_val.jsonl" and path.read_bytes() == fake_fetch.body
    assert fake_fetch.calls == [hs.URL]
    assert os.listdir(out_dir) == ["hellaswag_val.jsonl"]  # no .tmp left behind
    assert hashlib.sha256(fake_fetch.body).hexdigest() in capsys.readouterr().out

    def must_not_fetch(url):
        raise AssertionError("a good file is already there")

    fake_fetch.set(must_not_fetch)
    assert hs.download(out_dir) == path and "already there" in capsys.readouterr().out


def test_download_rejects_bad_downloads_and_keeps_nothing(tmp_path, fake_fetch, monkeypatch):
    out_dir = tmp_path / "hs"
    body = fake_fetch.body
    fake_fetch.set(lambda url: FakeResponse(body, length=len(body) + 10))
    with pytest.raises(ValueError, match="truncated"):
        hs.download(out_dir)
    assert os.listdir(out_dir) == []

    fake_fetch.set(lambda url: FakeResponse(body))
    monkeypatch.setattr(hs, "VAL_EXAMPLES", 7)
    with pytest.raises(ValueError, match="6 examples, expected 7"):
        hs.download(out_dir)
    assert os.listdir(out_dir) == []

    monkeypatch.setattr(hs, "VAL_EXAMPLES", 6)
    lines = body.splitlines(keepends=True)
    broken = b"".join(lines[:2] + [b'{"ctx": "oops"\n'] + lines[3:])
    fake_fetch.set(lambda url: FakeResponse(broken))
    with pytest.raises(ValueError, match=r"hellaswag_val\.jsonl\.tmp:3: not a JSON line"):
        hs.download(out_dir)
    assert os.listdir(out_dir) == []

    def offline(url):
        raise urllib.error.URLError("no network")

    fake_fetch.set(offline)
    with pytest.raises(ConnectionError, match="no network"):
        hs.download(out_dir)


def test_download_replaces_a_damaged_file_and_cli(tmp_path, fake_fetch, capsys):
    out_dir = tmp_path / "hs"
    out_dir.mkdir()
    (out_dir / "hellaswag_val.jsonl").write_bytes(fake_fetch.body[:300])  # an old partial copy
    path = hs.main(["download", "--out-dir", str(out_dir)])
    assert path.read_bytes() == fake_fetch.body
    assert "fails the checks" in capsys.readouterr().out
