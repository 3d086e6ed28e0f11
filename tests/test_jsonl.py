"""The one JSON-lines reader (log.jsonl, HellaSwag, local datasets): numbering, blank lines, the
errors that name a line, and the torn last line a full disk leaves."""

import gzip
import re

import pytest

from gpt2_fused.training.jsonl import iter_jsonl, read_jsonl


def test_values_are_numbered_by_line_and_blank_lines_skipped(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"step": 0}\n\n  \t\n[1, "caf\xc3\xa9"]\r\n7\n"last, no newline"')
    assert list(iter_jsonl(path)) == [
        (1, {"step": 0}),
        (4, [1, "café"]),
        (5, 7),
        (6, "last, no newline"),
    ]
    assert read_jsonl(path) == [{"step": 0}, [1, "café"], 7, "last, no newline"]
    assert read_jsonl(path, torn_tail=True) == read_jsonl(path)  # a whole last line stays


@pytest.mark.parametrize(
    "data, line, message",
    [
        (b'{"a": 1}\n{"a": caf\xe9}\n', 2, "not UTF-8 (invalid continuation byte at byte 9)"),
        (b'{"a": 1}\n\n{"a": 1,}\n{"a": 2}\n', 3, "not a JSON line (Expecting property name"),
        (b'{"a": 1}\n{"a": 2', 2, "not a JSON line (Expecting ',' delimiter at column 8)"),
    ],
    ids=["utf8", "json", "cut-short"],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path, data, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(f"{path}:{line}: {message}")):
        read_jsonl(path)


def test_torn_tail_drops_only_a_last_line_without_its_newline(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')  # a write cut short
    assert read_jsonl(path, torn_tail=True) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo\n')  # damaged, not cut short
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: not a JSON line")):
        read_jsonl(path, torn_tail=True)
    path.write_text('{"step": 0}\n{"st\n{"step": 2}')  # damaged in the middle
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not a JSON line")):
        read_jsonl(path, torn_tail=True)


def test_lines_from_the_caller_are_read_alike(tmp_path):
    """A compressed file: the caller opens it and passes its text lines; path names it."""
    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write('{"text": "one"}\n\n{"text": "two"}\n{"text": oops}\n')
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = iter_jsonl(path, lines=f)
        assert next(rows) == (1, {"text": "one"}) and next(rows) == (3, {"text": "two"})
        with pytest.raises(ValueError, match=re.escape(f"{path}:4: not a JSON line")):
            next(rows)
