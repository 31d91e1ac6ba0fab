"""Document sources: the Python standard library (default, on every machine), local
text files / globs (one document per file) and JSON-lines (one per line).

`documents(cfg, split)` gives the `DocumentSource` (random access, read on demand) of
`split`, "train" or "validation": a split fixed by a hash of each document's name
(`is_validation`) unless `data.val_paths` names the validation files. Every jsonl line
is checked when the source is built: a ValueError names the file, the 1-based line and
the field. See docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence

from tfjax.config import DataConfig
from tfjax.data.inputs import find_inputs

__all__ = ["INSTRUCTION_FIELDS", "DocumentSource", "documents", "expand_paths", "is_validation",
           "stdlib_files"]

VAL_MODULUS = 50
INSTRUCTION_FIELDS = ("prompt", "completion")  # data.format="instruction": one pair per line
SKIP_DIRS = ("site-packages", "test")


def is_validation(key: str) -> bool:
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest(), 16) % VAL_MODULUS == 0


def stdlib_files(split: str, root: str | None = None) -> list[str]:
    """Sorted absolute paths of the stdlib's `.py` files of `split` (train | validation),
    skipping any `site-packages` and `test` directories."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                if is_validation(rel) == (split == "validation"):
                    out.append(path)
    return sorted(out)


def expand_paths(patterns: Sequence[str], field: str) -> list[tuple[str, str]]:
    """(path, split key) of every file the patterns (files, globs, directories) name,
    found as `python -m tfjax.data.prepare` finds its inputs (`find_inputs`); the key
    is the path relative to the pattern's directory (its part before any wildcard), so
    the split does not depend on where the corpus lives. What only a token cache reads
    (parquet, a `datasets` directory) is a ValueError naming `field` and the fix."""
    found = find_inputs(patterns, field)
    for i in found:
        if "://" in i.path:
            raise ValueError(f"{field}: {i.path}: text and jsonl sources read local files; "
                             f"prepare a token cache (`python -m tfjax.data.prepare ... "
                             f"--output gs://...`) and train from it (data.source='cache')")
        if i.kind in ("parquet", "dataset"):
            raise ValueError(f"{field}: {i.path} is a {i.kind}; text and jsonl sources read "
                             f"text and JSON lines as they train: tokenize it once with "
                             f"`python -m tfjax.data.prepare` and train from the cache "
                             f"(data.source='cache')")
    return [(i.path, i.name) for i in found]


class DocumentSource:
    """A random-access list of documents (bytes). Files are read when asked for, so
    a large corpus is never held in memory; jsonl records are indexed by offset (their
    lines were checked when indexed: JSON objects whose `field` is a string). With
    `field` a tuple of names (instruction examples: `INSTRUCTION_FIELDS`), a record is
    the tuple of those strings."""

    def __init__(self, files: Sequence[str] = (), records: Sequence[tuple[str, int]] = (),
                 field: str | tuple[str, ...] = "text"):
        self._files = list(files)
        self._records = list(records)  # (path, byte offset of the line)
        self._field = field

    def __len__(self) -> int:
        return len(self._files) + len(self._records)

    def __getitem__(self, i: int) -> bytes | tuple[str, ...]:
        if i < len(self._files):
            with open(self._files[i], "rb") as f:
                return f.read()
        path, offset = self._records[i - len(self._files)]
        with open(path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        record = json.loads(line)
        if isinstance(self._field, tuple):
            return tuple(record[f] for f in self._field)
        return record[self._field].encode("utf-8")


_CHUNK = 1 << 16


def _some(paths: Sequence[str], n: int = 3) -> str:
    return ", ".join(paths[:n]) + (f", ... ({len(paths)} files)" if len(paths) > n else "")


def _has_text(path: str) -> bool:
    """Whether the file holds anything but whitespace (read in chunks, up to the first
    byte that is not)."""
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            if chunk.strip():
                return True
    return False


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _jsonl_text(path: str, lineno: int, line: bytes, field: str) -> str:
    """The `field` string of one jsonl line (`lineno` 1-based), or a ValueError naming
    the file, the line, the field and the fix."""
    where = f"{path}:{lineno}"
    try:
        record = json.loads(line)
    except ValueError as e:  # json.JSONDecodeError, or bytes that are not UTF-8
        detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ValueError(f"{where}: not a JSON line ({detail}); data.source='jsonl' reads one "
                         "JSON object per line: fix or drop this line, or use data.source='text' "
                         "for plain text files") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: the line is {_json_type(record)}, not a JSON object with "
                         f"field {field!r}; data.source='jsonl' reads one object per line, e.g. "
                         f'{{"{field}": "..."}}') from None
    if field not in record:
        strings = [k for k, v in record.items() if isinstance(v, str)]
        hint = (f"set data.jsonl_field to the field that holds the text (e.g. "
                f"--config.data.jsonl_field={strings[0]}; string fields here: "
                f"{', '.join(strings)})" if strings else
                "set data.jsonl_field=... to the field that holds the text")
        raise ValueError(f"{where}: the record has no field {field!r} (data.jsonl_field); its "
                         f"fields: {', '.join(record) or 'none'}; {hint}")
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} (data.jsonl_field) is {_json_type(value)}, "
                         "not a string; point data.jsonl_field=... at the field that holds the "
                         "text as a string")
    return value


def _jsonl_pair(path: str, lineno: int, line: bytes) -> str:
    """The completion of one instruction line (after checking that it is a JSON object
    with a `prompt` and a `completion` string), or a ValueError naming the file, the
    line, the field and the fix."""
    where, form = f"{path}:{lineno}", ('data.format=\'instruction\' reads one JSON object per '
                                       'line with a "prompt" and a "completion" string')
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not a JSON line ({e}); {form}: fix or drop this line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: the line is {_json_type(record)}, not a JSON object; {form}")
    for name in INSTRUCTION_FIELDS:
        if name not in record:
            raise ValueError(f"{where}: the record has no field {name!r}; {form} (its fields: "
                             f"{', '.join(record) or 'none'}): add {name!r}, or train on plain "
                             f"documents with data.format='document'")
        if not isinstance(record[name], str):
            raise ValueError(f"{where}: field {name!r} is {_json_type(record[name])}, not a "
                             f"string; {form}")
    return record["completion"]


def _jsonl_records(files: Sequence[tuple[str, str]], split: str | None,
                   field: str | tuple[str, ...]) -> tuple[list[tuple[str, int]], str]:
    """(path, byte offset) of the non-blank records of `split` (None: every line) and, for
    an empty result, what was found. Every line of every file is checked (`_jsonl_text`),
    whichever split it goes to, so a bad line fails the first split built."""
    out = []
    lines = blank = empty = 0
    for path, key in files:
        with open(path, "rb") as f:
            offset = 0
            for lineno, line in enumerate(f):
                mine = split is None or is_validation(f"{key}:{lineno}") == (split == "validation")
                lines += mine
                if not line.strip():
                    blank += mine
                elif not (_jsonl_pair(path, lineno + 1, line) if isinstance(field, tuple)
                          else _jsonl_text(path, lineno + 1, line, field)).strip():
                    empty += mine
                elif mine:
                    out.append((path, offset))
                offset += len(line)
    what = ("'completion'" if isinstance(field, tuple) else f"{field!r} (data.jsonl_field)")
    found = (f"{lines} line(s) of this split in {_some([p for p, _ in files])}: {blank} blank, "
             f"{empty} whose {what} is empty or whitespace only")
    return out, found


def documents(cfg: DataConfig, split: str) -> DocumentSource:
    """The documents of `split` ("train" or "validation") for a data config; an empty
    split is a ValueError that says what was looked at."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if cfg.source == "stdlib":
        src = DocumentSource(stdlib_files(split))
        where = f"the stdlib .py files under {sysconfig.get_paths()['stdlib']}"
    else:
        explicit = bool(cfg.val_paths)
        if split == "validation" and explicit:
            files, rule = expand_paths(cfg.val_paths, "data.val_paths"), None
        else:
            files = expand_paths(cfg.paths, "data.paths")
            rule = None if (explicit and split == "train") else split
        if cfg.source == "text":
            if rule is not None:
                files = [(f, k) for f, k in files if is_validation(k) == (rule == "validation")]
            has_text = [(f, _has_text(f)) for f, _ in files]
            src = DocumentSource([f for f, ok in has_text if ok])
            blank = [f for f, ok in has_text if not ok]
            found = (f"{len(files)} file(s) of this split, {len(blank)} empty or whitespace only"
                     + (f" ({_some(blank)})" if blank else ""))
        else:
            field = INSTRUCTION_FIELDS if cfg.format == "instruction" else cfg.jsonl_field
            records, found = _jsonl_records(files, rule, field)
            src = DocumentSource(records=records, field=field)
        where = f"data.paths={cfg.paths!r}" + (f", data.val_paths={cfg.val_paths!r}" if explicit else "")
        where += f": {found}"
    if len(src) == 0:
        field = "data.val_paths" if (split == "validation" and cfg.val_paths) else "data.paths"
        hint = ("; 1 in 50 files (text) or lines (jsonl) goes to validation by the sha1 rule: "
                "give more, or set data.val_paths" if split == "validation" and not cfg.val_paths
                else f"; point {field} at files with text")
        raise ValueError(f"{field}: the {split} split is empty: no documents in {where}{hint}")
    return src
