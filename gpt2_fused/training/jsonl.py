"""JSON lines, one JSON value a line: train.py's out_dir/log.jsonl, HellaSwag's file, local
datasets (data/prepare.py). One reader for all of them, whose errors name the file and line.

    iter_jsonl(path)    (line number, value) of each non-blank line, streamed
    read_jsonl(path)    the values, in a list
"""

import json


def iter_jsonl(path, lines=None, torn_tail=False):
    """(line number, value) of each non-blank line of the JSON-lines file at path, read as bytes
    so that bad UTF-8 names its line. lines: the file's lines (str or bytes) where the caller opens
    it (a compressed file); path then only names it. A line that is not UTF-8 or not JSON is a
    ValueError naming path:line. torn_tail: a last line that is not JSON and has no newline (a
    write cut short by a full disk or a kill) ends the values instead."""
    if lines is None:
        with open(path, "rb") as f:
            yield from iter_jsonl(path, f, torn_tail)
        return
    for n, line in enumerate(lines, 1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            if torn_tail and not line.endswith("\n"):  # only the file's last line can end so
                return
            raise ValueError(f"{path}:{n}: not a JSON line ({e.msg} at column {e.colno})") from None
        yield n, value


def read_jsonl(path, torn_tail=False):
    """The values of the JSON-lines file at path, in a list (see iter_jsonl)."""
    return [value for _, value in iter_jsonl(path, torn_tail=torn_tail)]
