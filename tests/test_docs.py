"""The record's links hold: every `RESULTS.md#anchor` that code or docs point to is a heading of
bench/RESULTS.md, and every `results/...` file or folder RESULTS.md cites is in bench/results."""

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
