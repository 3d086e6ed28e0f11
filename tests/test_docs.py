"""The record's links hold and it stays light: every `RESULTS.md#anchor` that code or docs point to
is a heading of bench/RESULTS.md, every `results/...` file or folder RESULTS.md cites is in
bench/results and every file there is named in RESULTS.md; RESULTS.md and dev/LOG.md keep to their
word limits, bench/ names say what they measure, and code carries no issue or session numbers."""

import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"


def anchors(markdown):
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def sources():
    """The repo's code and docs; hidden folders (.git, a .venv, a copy of an older tree for a
    benchmark) are not the repo's."""
    skip = ("bench/results/", "dev/LOG.md", "data/cache/", "tests/test_docs.py")
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part.startswith(".") for part in rel.parts[:-1]):
            continue
        if path.suffix in (".py", ".md", ".sh") and not rel.as_posix().startswith(skip):
            yield rel.as_posix(), path.read_text()


def test_every_results_anchor_pointed_to_exists():
    have = anchors(RESULTS.read_text())
    missing = [
        f"{rel}: #{a}"
        for rel, text in sources()
        for a in re.findall(r"RESULTS\.md#([\w-]+)", text)
        if a not in have
    ]
    assert not missing, "\n".join(missing)


def test_every_results_file_cited_is_kept():
    kept = [p.relative_to(RESULTS.parent / "results").as_posix()
            for p in (RESULTS.parent / "results").rglob("*") if p.is_file()]  # fmt: skip
    missing = []
    for cite in set(re.findall(r"`results/([\w.*/-]+)", RESULTS.read_text())) - {"X"}:
        cite = cite.rstrip("/.")  # "X": the page's own legend
        if not any(k == cite or k.startswith(cite + "/") or fnmatch.fnmatch(k, cite) or
                   fnmatch.fnmatch(k, cite + "*") for k in kept):  # fmt: skip
            missing.append(cite)
    assert not missing, f"cited in bench/RESULTS.md, not in bench/results: {sorted(missing)}"


def test_anchors_follow_githubs_rule():
    assert anchors("## CUDA graphs\n### Inductor's in-place buffer bug") == {
        "cuda-graphs",
        "inductors-in-place-buffer-bug",
    }


RECORD_LIMITS = {"bench/RESULTS.md": 8_000, "dev/LOG.md": 5_000}  # words, as `wc -w` counts
RESULTS_FILES_MAX = 40


def test_the_record_stays_within_its_word_limits():
    over = {
        rel: len((ROOT / rel).read_text().split())
        for rel, limit in RECORD_LIMITS.items()
        if len((ROOT / rel).read_text().split()) > limit
    }
    assert not over, f"words over the limit ({RECORD_LIMITS}): {over}"


def test_bench_results_holds_few_files_each_named_in_results_md():
    files = [p for p in (RESULTS.parent / "results").rglob("*") if p.is_file()]
    assert len(files) <= RESULTS_FILES_MAX, f"{len(files)} files in bench/results"
    text = RESULTS.read_text()
    uncited = [p.relative_to(ROOT).as_posix() for p in files if p.name not in text]
    assert not uncited, f"in bench/results, not named in bench/RESULTS.md: {uncited}"


def test_no_issue_or_session_numbers_in_code():
    """Code says why, not which of this repo's issues or work sessions it came from: git history
    keeps that. Upstream references (`pytorch/pytorch#144344`) are fine."""
    ref = re.compile(r"\bissues? \d+|(?<![\"'_])\bsessions?\b(?![\"'])", re.IGNORECASE)
    found = [
        f"{rel}:{n}: {line.strip()}"
        for rel, text in sources()
        if rel.endswith(".py")
        for n, line in enumerate(text.splitlines(), 1)
        if ref.search(line)
    ]
    assert not found, "\n".join(found)


def test_bench_names_say_what_they_measure():
    """No benchmark named after a GPU, a device call or an issue (`ddp_h200.sh`, `fp8_call.sh`)."""
    bad = re.compile(r"h100|h200|a100|_call\b|call\d|issue|session|_run\d", re.IGNORECASE)
    named = [p.name for p in (RESULTS.parent).iterdir() if p.is_file() and bad.search(p.stem)]
    named += [
        p.relative_to(RESULTS.parent).as_posix()
        for p in (RESULTS.parent / "results").rglob("*")
        if bad.search(p.relative_to(RESULTS.parent / "results").as_posix())
    ]
    assert not named, named
