"""Document sources: the Python standard library (default, on every machine), local
text files / globs (one document per file) and JSON-lines (one per line).

Splits are fixed by names, not by random draws: a stdlib file is in validation iff
`int(sha1(path relative to the stdlib).hexdigest(), 16) % 50 == 0` (posix
separators); the same rule applies to text files (on the path relative to the
glob's directory) and to jsonl records (on "relative path:line number"), unless
`val_paths` names the validation files explicitly.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence

from tfjax.config import DataConfig

__all__ = ["DocumentSource", "documents", "is_validation", "stdlib_files"]

VAL_MODULUS = 50
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


def _expand(patterns: Sequence[str], field: str) -> list[tuple[str, str]]:
    """(path, split key) of every file the patterns match; the key is the path relative
    to the pattern's directory (its part before any wildcard), so the split does not
    depend on where the corpus lives."""
    files: list[tuple[str, str]] = []
    for pat in patterns:
        pat = os.path.expanduser(pat)
        hits = sorted(h for h in glob.glob(pat, recursive=True) if os.path.isfile(h))
        if not hits:
            raise ValueError(f"{field}: {pat!r} matches no file")
        literal = pat.split("*")[0].split("?")[0].split("[")[0]
        base = literal if literal.endswith(os.sep) else os.path.dirname(literal)
        files += [(h, os.path.relpath(h, base or ".").replace(os.sep, "/")) for h in hits]
    return files


class DocumentSource:
    """A random-access list of documents (bytes). Files are read when asked for, so
    a large corpus is never held in memory; jsonl records are indexed by offset."""

    def __init__(self, files: Sequence[str] = (), records: Sequence[tuple[str, int]] = (),
                 field: str = "text"):
        self._files = list(files)
        self._records = list(records)  # (path, byte offset of the line)
        self._field = field

    def __len__(self) -> int:
        return len(self._files) + len(self._records)

    def __getitem__(self, i: int) -> bytes:
        if i < len(self._files):
            with open(self._files[i], "rb") as f:
                return f.read()
        path, offset = self._records[i - len(self._files)]
        with open(path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        value = json.loads(line)[self._field]
        return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def _jsonl_records(files: Sequence[tuple[str, str]], split: str | None,
                   field: str) -> list[tuple[str, int]]:
    out = []
    for path, key in files:
        with open(path, "rb") as f:
            offset, lineno = 0, 0
            for line in f:
                if line.strip():
                    if split is None or is_validation(f"{key}:{lineno}") == (split == "validation"):
                        out.append((path, offset))
                offset += len(line)
                lineno += 1
    return out


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
            files, rule = _expand(cfg.val_paths, "data.val_paths"), None
        else:
            files = _expand(cfg.paths, "data.paths")
            rule = None if (explicit and split == "train") else split
        if cfg.source == "text":
            if rule is not None:
                files = [(f, k) for f, k in files if is_validation(k) == (rule == "validation")]
            src = DocumentSource([f for f, _ in files])
        else:
            src = DocumentSource(records=_jsonl_records(files, rule, cfg.jsonl_field),
                                 field=cfg.jsonl_field)
        where = f"data.paths={cfg.paths!r}" + (f", data.val_paths={cfg.val_paths!r}" if explicit else "")
    if len(src) == 0:
        field = "data.val_paths" if (split == "validation" and cfg.val_paths) else "data.paths"
        hint = (" (1 in 50 files goes to validation by the sha1 rule; give more files or set "
                "data.val_paths)" if split == "validation" and not cfg.val_paths else "")
        raise ValueError(f"{field}: the {split} split is empty: no documents in {where}{hint}")
    return src
