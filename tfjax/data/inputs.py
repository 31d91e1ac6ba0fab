"""The inputs of `python -m tfjax.data.prepare`: finding them (files, globs, directories),
cutting them into pieces of about a shard's size, and reading a piece's documents.

Kinds: `.jsonl` / `.json` (also `.gz`, `.zst`; a `.json` file holds a list of objects or
JSON lines), `.parquet` (a column), a Hugging Face `datasets` directory (`save_to_disk`),
any other file as text (one document). Each document has a name, its split key for
`is_validation`: a text file's relative path, a record's "<relative path>:<0-based line,
item or row>" (as `data.source="jsonl"` names lines). Blank documents are skipped. Bad
input is a one-line ValueError naming the file, the line / row and `--field`.
`read_records` gives whole records (several fields or columns) of any kind, for the
objectives that read examples (`tfjax.data.objectives.read_examples`). See docs/data.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np
from etils import epath

__all__ = ["Input", "Piece", "find_inputs", "pieces", "read_piece", "read_records"]

_DATASET_FILES = ("dataset_info.json", "state.json")
_BATCH = 1024  # rows per parquet / datasets batch


@dataclasses.dataclass(frozen=True)
class Input:
    path: str  # where it is read from
    name: str  # relative name: the base of its documents' names
    kind: str  # "text" | "jsonl" | "json" | "parquet" | "dataset"
    size: int  # bytes on disk (a dataset: its files)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of one input: rows / row groups [start, stop), or jsonl bytes [start, stop)
    whose first line is line `first` (0-based); (0, 0) for a whole input."""

    input: int
    start: int = 0
    stop: int = 0
    first: int = 0
    size: int = 0


def _need(module: str, package: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(f"{what} needs the `{package}` package: pip install 'tfjax[data]'"
                         ) from None


def _kind(path: epath.Path) -> str:
    name = path.name.lower()
    plain = name.removesuffix(".gz").removesuffix(".zst").removesuffix(".zstd")
    if plain.endswith(".parquet"):
        if plain != name:
            raise ValueError(f"{path}: a compressed parquet file; parquet compresses its "
                             "own columns: give the .parquet file")
        return "parquet"
    return "jsonl" if plain.endswith(".jsonl") else "json" if plain.endswith(".json") else "text"


def _is_dataset(d: epath.Path) -> bool:
    return (d / "dataset_dict.json").exists() or all((d / f).exists() for f in _DATASET_FILES)


def _size(path: epath.Path) -> int:
    if path.is_dir():
        return sum(_size(p) for p in path.iterdir())
    return path.stat().length


def _walk(root: epath.Path, d: epath.Path) -> Iterator[tuple[epath.Path, str]]:
    """(path, name relative to root) of the files and dataset directories under d;
    hidden entries (".git", ".DS_Store") skipped."""
    for p in d.iterdir():
        if p.name.startswith("."):
            continue
        if p.is_dir() and not _is_dataset(p):
            yield from _walk(root, p)
        else:
            yield p, p.relative_to(root).as_posix()


def _input(path: epath.Path, name: str) -> Input:
    try:
        if path.is_dir():
            return Input(str(path), name, "dataset", _size(path))
        return Input(str(path), name, _kind(path), path.stat().length)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from None


def find_inputs(patterns: Sequence[str], field: str = "") -> list[Input]:
    """The inputs that files, globs and directories (local, `~` expanded, or on a
    bucket) name, in order (each directory and glob sorted by relative path, as
    `sorted(glob)`; hidden entries skipped); a pattern that names nothing is a
    ValueError naming `field` (the config field or flag; default: "input")."""
    found: dict[str, Input] = {}
    for pat in patterns:
        where = f"{field}: {pat!r}" if field else f"input {pat!r}"
        pat = pat if "://" in pat else os.path.expanduser(pat)
        hits: list[tuple[epath.Path, str]]
        if any(c in pat for c in "*?["):
            literal = pat.split("*")[0].split("?")[0].split("[")[0]
            cut = literal.rfind("/") + 1  # names are relative to the glob's directory
            base, rest = epath.Path(pat[:cut] or "."), pat[cut:]
            # locally the standard glob (`**` recursive); on a bucket epath's (no `**`)
            paths = (sorted(base.glob(rest)) if "://" in pat else
                     [epath.Path(h) for h in sorted(glob.glob(pat, recursive=True))])
            named = ((p, p.relative_to(base).as_posix()) for p in paths)
            hits = [(p, name) for p, name in named
                    if not any(part.startswith(".") for part in name.split("/"))
                    and (p.is_file() or _is_dataset(p))]
        else:
            p = epath.Path(pat)
            if not p.exists():
                raise ValueError(f"{where}: no such file or directory")
            hits = ([(p, p.name)] if p.is_file() or _is_dataset(p)
                    else sorted(_walk(p, p), key=lambda h: h[1]))
        if not hits:
            raise ValueError(f"{where} matches no file (a glob, or an empty directory)")
        for p, name in hits:
            found.setdefault(str(p), _input(p, name))
    if not found:
        raise ValueError("no inputs: give files, globs or directories to prepare")
    return list(found.values())


def _line_cuts(path: epath.Path, size: int, target: int) -> list[tuple[int, int]]:
    """(byte offset, 0-based line) of line starts about `target` bytes apart, from 0."""
    cuts, pos, line, want = [(0, 0)], 0, 0, target
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            while want < pos + len(chunk):
                nl = chunk.find(b"\n", max(want - pos, 0))
                if nl < 0:
                    break
                if pos + nl + 1 < size:
                    cuts.append((pos + nl + 1, line + chunk.count(b"\n", 0, nl + 1)))
                want = pos + nl + 1 + target
            line += chunk.count(b"\n")
            pos += len(chunk)
    return cuts


def pieces(inputs: Sequence[Input], target: int, field: str) -> list[Piece]:
    """Every input cut into pieces of at most about `target` bytes, where it can be cut:
    uncompressed jsonl at line starts, parquet at row groups, datasets by rows."""
    out = []
    for i, inp in enumerate(inputs):
        try:
            out += _pieces(i, inp, target, field)
        except OSError as e:
            raise ValueError(f"{inp.path}: cannot read ({e}); check the file") from None
    return out


def _pieces(i: int, inp: Input, target: int, field: str) -> list[Piece]:
    path = epath.Path(inp.path)
    if inp.kind == "jsonl" and path.suffix == ".jsonl" and inp.size > target:
        cuts = _line_cuts(path, inp.size, target) + [(inp.size, -1)]
        return [Piece(i, a, b, line, b - a) for (a, line), (b, _) in zip(cuts, cuts[1:])]
    if inp.kind == "parquet":
        with path.open("rb") as f:
            meta = _parquet_file(inp, f).metadata
        starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        rows = max(meta.num_rows, 1)
        return [Piece(i, g, g + 1, int(starts[g]), inp.size * int(starts[g + 1] - starts[g])
                      // rows) for g in range(meta.num_row_groups)]
    if inp.kind == "dataset":
        rows = len(_dataset(inp, (field,), *_FIELD))
        step = max(1, rows * target // max(inp.size, 1))
        return [Piece(i, a, min(a + step, rows), a, inp.size * (min(a + step, rows) - a) // rows)
                for a in range(0, rows, step)]
    return [Piece(i, size=inp.size)]


def _parquet_file(inp: Input, f):
    pq = _need("pyarrow.parquet", "pyarrow", f"{inp.path}: a parquet file")
    try:
        return pq.ParquetFile(f)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        f.close()
        raise ValueError(f"{inp.path}: not a readable parquet file ({e}); check the file"
                         ) from None


@contextlib.contextmanager
def _open(path: epath.Path):
    """The file's bytes, decompressed (.gz, .zst)."""
    with path.open("rb") as f:
        if path.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=f) as g:
                yield g
        elif path.name.endswith((".zst", ".zstd")):
            zstd = _need("zstandard", "zstandard", f"{path}: a zstd-compressed file")
            with io.BufferedReader(zstd.ZstdDecompressor().stream_reader(f)) as z:
                yield z
        else:
            yield f


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _text(value, where: str, field: str) -> str:
    """The `field` string of a record, or a ValueError naming `where` and the field."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: the record is {_json_type(value)}, not a JSON object with "
                         f"field {field!r} (--field)")
    if field not in value:
        strings = [k for k, v in value.items() if isinstance(v, str)]
        raise ValueError(f"{where}: the record has no field {field!r} (--field); its fields: "
                         f"{', '.join(value) or 'none'}; set --field to the one that holds the "
                         f"text{' (string fields: ' + ', '.join(strings) + ')' if strings else ''}")
    return _string(value[field], where, field)


def _string(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} (--field) is {_json_type(value)}, not a "
                         "string; point --field at the field that holds the text")
    return value


def _json_lines(inp: Input, piece: Piece) -> Iterator[tuple[str, str, object]]:
    """(name, where, JSON value) of the piece's lines that are not blank."""
    path = epath.Path(inp.path)
    with _open(path) as f:
        if piece.stop:
            f.seek(piece.start)
        pos, lineno = piece.start, piece.first
        for line in f:
            if piece.stop and pos >= piece.stop:
                break
            pos += len(line)
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as e:
                    detail = (f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError)
                              else str(e))
                    raise ValueError(f"{inp.path}:{lineno + 1}: not a JSON line ({detail}); a "
                                     f"{inp.kind} input holds one JSON object per line"
                                     + (" or a list of objects" if inp.kind == "json" else "")
                                     + ": fix or drop this line") from None
                yield f"{inp.name}:{lineno}", f"{inp.path}:{lineno + 1}", record
            lineno += 1


def _lines(inp: Input, piece: Piece, field: str) -> Iterator[tuple[str, str]]:
    for name, where, record in _json_lines(inp, piece):
        yield name, _text(record, where, field)


def _json_items(inp: Input) -> Iterator[tuple[str, str, object]]:
    """(name, where, JSON value) of each item of a file that holds one JSON list."""
    with _open(epath.Path(inp.path)) as f:
        try:
            items = json.load(f)
        except ValueError as e:
            raise ValueError(f"{inp.path}: not a JSON list of objects ({e})") from None
    for i, item in enumerate(items):
        yield f"{inp.name}:{i}", f"{inp.path}: item {i} (0-based)", item


def _json_list(inp: Input, field: str) -> Iterator[tuple[str, str]]:
    for name, where, item in _json_items(inp):
        yield name, _text(item, where, field)


# prepare's one column: what a missing one is called, and the fix
_FIELD = (" (--field)", "set --field to the column that holds the text")


def _check_columns(inp: Input, have: Sequence[str], want: Sequence[str], label: str,
                   fix: str) -> None:
    for column in want:
        if column not in have:
            raise ValueError(f"{inp.path}: no column {column!r}{label}; its columns: "
                             f"{', '.join(have) or 'none'}; {fix}")


def _parquet_batches(inp: Input, piece: Piece, columns: Sequence[str], label: str,
                     fix: str) -> Iterator[tuple[int, object]]:
    """(first row, pyarrow RecordBatch of `columns`) of the piece's row groups (a whole
    piece: every row group); a missing column is a ValueError naming it, `label`, `fix`."""
    with epath.Path(inp.path).open("rb") as f:
        pf = _parquet_file(inp, f)
        _check_columns(inp, pf.schema_arrow.names, columns, label, fix)
        groups = range(piece.start, piece.stop) if piece.stop else range(pf.num_row_groups)
        row = piece.first
        for batch in pf.iter_batches(_BATCH, row_groups=groups, columns=list(columns)):
            yield row, batch
            row += batch.num_rows


def _parquet(inp: Input, piece: Piece, field: str) -> Iterator[tuple[str, str]]:
    for first, batch in _parquet_batches(inp, piece, (field,), *_FIELD):
        for row, value in enumerate(batch.column(0).to_pylist(), first):
            yield f"{inp.name}:{row}", _string(value, f"{inp.path}: row {row} (0-based)", field)


@functools.lru_cache(maxsize=4)
def _load_dataset(inp: Input):
    """The `datasets.Dataset` of a `save_to_disk` directory; of a DatasetDict, its
    "train" split (the others are not read: give DIR/<split> to read one)."""
    datasets = _need("datasets", "datasets", f"{inp.path}: a Hugging Face datasets directory")
    ds = datasets.load_from_disk(inp.path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{inp.path}: a DatasetDict without a 'train' split (splits: "
                             f"{', '.join(ds)}); give the split's directory, e.g. "
                             f"{inp.path}/{next(iter(ds), 'SPLIT')}")
        ds = ds["train"]
    return ds


def _dataset(inp: Input, columns: Sequence[str], label: str, fix: str):
    """`_load_dataset`, after checking that it has `columns` (`_check_columns`)."""
    ds = _load_dataset(inp)
    _check_columns(inp, ds.column_names, columns, label, fix)
    return ds


def _dataset_rows(inp: Input, piece: Piece, field: str) -> Iterator[tuple[str, str]]:
    ds = _dataset(inp, (field,), *_FIELD)
    for a in range(piece.start, piece.stop, _BATCH):
        for row, value in enumerate(ds[a:min(a + _BATCH, piece.stop)][field], a):
            yield f"{inp.name}:{row}", _string(value, f"{inp.path}: row {row} (0-based)", field)


def read_records(inp: Input, columns: Sequence[str], label: str = "",
                 fix: str = "") -> Iterator[tuple[str, str, object]]:
    """(name, where, record) of every record of a whole input, in order: the JSON value of
    each line that is not blank (jsonl; a text file is read as JSON lines) or item (a
    .json list), or a dict of `columns` per row (parquet, dataset). `name` is its split
    key (as `read_piece` names documents), `where` "file:line" (1-based) or "file: row
    r (0-based)" for errors. A parquet file or dataset without one of `columns` is a
    ValueError naming the file and the column, `label` after it, then `fix`."""
    try:
        if inp.kind == "parquet":
            for first, batch in _parquet_batches(inp, Piece(0), columns, label, fix):
                for row, rec in enumerate(batch.to_pylist(), first):
                    yield f"{inp.name}:{row}", f"{inp.path}: row {row} (0-based)", rec
        elif inp.kind == "dataset":
            ds = _dataset(inp, columns, label, fix).select_columns(list(columns))
            for a in range(0, len(ds), _BATCH):
                part = ds[a:a + _BATCH]
                for i in range(min(_BATCH, len(ds) - a)):
                    yield (f"{inp.name}:{a + i}", f"{inp.path}: row {a + i} (0-based)",
                           {c: part[c][i] for c in columns})
        elif inp.kind == "json" and _starts_a_list(inp):
            yield from _json_items(inp)
        else:
            yield from _json_lines(dataclasses.replace(inp, kind="jsonl") if inp.kind == "text"
                                   else inp, Piece(0))
    except (OSError, EOFError) as e:
        raise ValueError(f"{inp.path}: cannot read ({e}); check the file") from None


def read_piece(inp: Input, piece: Piece, field: str) -> Iterator[tuple[str, str | bytes]]:
    """(name, text) of the piece's documents that are not blank, in order."""
    try:
        if inp.kind == "text":
            with _open(epath.Path(inp.path)) as f:
                docs = [(inp.name, f.read())]
        elif inp.kind == "parquet":
            docs = _parquet(inp, piece, field)
        elif inp.kind == "dataset":
            docs = _dataset_rows(inp, piece, field)
        elif inp.kind == "json" and _starts_a_list(inp):
            docs = _json_list(inp, field)
        else:
            docs = _lines(inp, piece, field)
        for name, text in docs:
            if text.strip():
                yield name, text
    except (OSError, EOFError) as e:
        raise ValueError(f"{inp.path}: cannot read ({e}); check the file") from None


def read_inputs(patterns: Sequence[str], field: str) -> Iterator[tuple[str, str | bytes]]:
    """(name, text) of every document that is not blank in the inputs `patterns` name,
    in order, in this process (each input one piece)."""
    found = find_inputs(patterns)
    for piece in pieces(found, 1 << 62, field):
        yield from read_piece(found[piece.input], piece, field)


def _starts_a_list(inp: Input) -> bool:
    with _open(epath.Path(inp.path)) as f:
        while chunk := f.read(4096):
            if chunk.strip():
                return chunk.lstrip()[:1] == b"["
    return False
