"""Token caches: ArrayRecord shards written once by `python -m tfjax.data.prepare`, read
by random access through `TokenCache(DIR, split).read(start, stop)`.

`DIR/<split>/<i>.arrayrecord` holds one record per document (its token ids, no specials,
little-endian uint16 or uint32), `<i>.lengths.npy` the documents' lengths and `<i>.json`
the shard's counts and sha256 checksums (present: the shard is finished).
`DIR/metadata.json`, written last, holds the tokenizer, the dtype and every shard. A
split's stream lays document d out as [bos_id] + ids + [eos_id]. See docs/data.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile

import numpy as np
from etils import epath

from tfjax import storage

__all__ = ["FORMAT_VERSION", "ShardWriter", "TokenCache", "finished_shard", "ids_dtype",
           "write_json"]

FORMAT_VERSION = 1
# One record per chunk: a document is read without decompressing its neighbours.
WRITER_OPTIONS = "group_size:1,uncompressed"
SPLITS = ("train", "validation")
_FIX = "re-run python -m tfjax.data.prepare with the same inputs and --output"


def ids_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def _sha256(path: epath.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: epath.Path, obj) -> None:
    """Write `obj` to `path` atomically (`tfjax.storage.write_atomic`)."""
    storage.write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _files(directory: epath.Path, split: str, index: int) -> dict[str, epath.Path]:
    base = directory / split
    return {k: base / f"{index:05d}{ext}" for k, ext in
            (("records", ".arrayrecord"), ("lengths", ".lengths.npy"), ("sidecar", ".json"))}


class ShardWriter:
    """Writes shard `index` of `split` under `directory`: documents added in order, then
    `finish()` renames the finished files into place and writes the sidecar last. On a
    bucket the shard is written to a local temporary directory, then uploaded (ArrayRecord's
    C++ writer takes local files only)."""

    def __init__(self, directory, split: str, index: int, dtype: np.dtype):
        from array_record.python.array_record_module import ArrayRecordWriter

        self._files = _files(storage.path(directory), split, index)
        self._remote = storage.is_remote(directory)
        if self._remote:
            self._staging = tempfile.TemporaryDirectory(prefix="tfjax-shard-")
            local = epath.Path(self._staging.name)
        else:
            local = self._files["records"].parent
            local.mkdir(parents=True, exist_ok=True)
        self._files["sidecar"].unlink(missing_ok=True)  # unfinished until finish() writes it
        self._tmp = local / (self._files["records"].name + ".tmp")
        self._dtype = np.dtype(dtype)
        self._writer = ArrayRecordWriter(os.fspath(self._tmp), WRITER_OPTIONS)
        self._lengths: list[int] = []

    def add(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(self._dtype).max):
            raise ValueError(f"{self._files['records']}: token id {int(ids.max())} does not "
                             f"fit the cache's {self._dtype.name} (the tokenizer's "
                             "vocab_size is smaller than its ids)")
        self._writer.write(ids.astype(self._dtype).tobytes())
        self._lengths.append(int(ids.size))

    def finish(self) -> dict:
        """Close, rename into place and write the sidecar; its entry for metadata.json."""
        self._writer.close()
        files = self._files
        lengths = io.BytesIO()
        np.save(lengths, np.asarray(self._lengths, np.int64))
        entry = {"file": f"{files['records'].parent.name}/{files['records'].name}",
                 "lengths": f"{files['lengths'].parent.name}/{files['lengths'].name}",
                 "num_documents": len(self._lengths), "num_tokens": int(sum(self._lengths)),
                 "bytes": self._tmp.stat().length, "sha256": _sha256(self._tmp),
                 "lengths_sha256": hashlib.sha256(lengths.getvalue()).hexdigest()}
        if self._remote:
            storage.upload(self._tmp, files["records"])
            self._staging.cleanup()
        else:
            self._tmp.replace(files["records"])
        storage.write_atomic(files["lengths"], lengths.getvalue())
        write_json(files["sidecar"], entry)
        return entry


def finished_shard(directory, split: str, index: int) -> dict | None:
    """The sidecar entry of a finished shard whose files verify (size and sha256), else
    None (never written, cut short, or damaged: to be written again)."""
    files = _files(storage.path(directory), split, index)
    try:
        entry = json.loads(files["sidecar"].read_text())
        ok = (files["records"].stat().length == entry["bytes"]
              and _sha256(files["records"]) == entry["sha256"]
              and _sha256(files["lengths"]) == entry["lengths_sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entry if ok else None


# Shards this process has checked (path, sha256): each is hashed once per process.
_VERIFIED: set[tuple[str, str]] = set()


class _Shard:
    """One open shard: its reader, its documents' stream offsets."""

    def __init__(self, directory: epath.Path, entry: dict):
        from array_record.python.array_record_module import ArrayRecordReader

        self.path = directory / entry["file"]
        where = f"{self.path}: damaged token cache shard"
        try:
            size = self.path.stat().length
        except OSError:
            raise ValueError(f"{self.path}: token cache shard is missing; {_FIX}") from None
        if size != entry["bytes"]:
            raise ValueError(f"{where} ({size} bytes, metadata.json says {entry['bytes']}); "
                             f"{_FIX}")
        lengths_path = directory / entry["lengths"]
        data = lengths_path.read_bytes() if lengths_path.exists() else b""
        try:  # ArrayRecord's C++ reader takes local files: a bucket's shard is downloaded
            self.local = storage.local_copy(self.path, entry["sha256"])
        except ValueError:
            raise ValueError(f"{where} (sha256 differs from metadata.json); {_FIX}") from None
        key = (self.local, entry["sha256"])
        if key not in _VERIFIED:
            if _sha256(epath.Path(self.local)) != entry["sha256"]:
                raise ValueError(f"{where} (sha256 differs from metadata.json); {_FIX}")
            _VERIFIED.add(key)
        if hashlib.sha256(data).hexdigest() != entry["lengths_sha256"]:
            raise ValueError(f"{lengths_path}: damaged token cache index (sha256 differs from "
                             f"metadata.json); {_FIX}")
        self.lengths = np.load(io.BytesIO(data))
        self.starts = np.concatenate([[0], np.cumsum(self.lengths + 2)])
        self.reader = ArrayRecordReader(self.local, "readahead_buffer_size:0")
        if self.reader.num_records() != len(self.lengths):
            raise ValueError(f"{where} ({self.reader.num_records()} records, its index says "
                             f"{len(self.lengths)}); {_FIX}")

    def records(self, first: int, stop: int, dtype: np.dtype) -> list[np.ndarray]:
        try:
            raw = self.reader.read(first, stop)
        except Exception as e:  # the C++ layer's errors: a record that does not read
            raise ValueError(f"{self.path}: damaged token cache shard (records {first}.."
                             f"{stop - 1} do not read: {e}); {_FIX}") from None
        out = [np.frombuffer(r, dtype) if len(r) % dtype.itemsize == 0 else None for r in raw]
        for d, ids in enumerate(out, first):
            if ids is None or len(ids) != self.lengths[d]:
                raise ValueError(f"{self.path}: damaged token cache shard (document {d} is "
                                 "not the length its index says); " + _FIX)
        return out


class TokenCache:
    """One split of a prepared token cache directory (`python -m tfjax.data.prepare`)."""

    def __init__(self, path: str, split: str = "train"):
        self.path, self.split = path, split
        self._dir = storage.path(path)
        self.name = self._dir.name
        meta_path = self._dir / "metadata.json"
        fix = f"run python -m tfjax.data.prepare INPUT... --output {path} --tokenizer TOK"
        if not meta_path.exists():
            state = ("is not a directory" if not self._dir.exists() else
                     "has no metadata.json (its prepare did not finish)"
                     if (self._dir / "prepare.json").exists() else "is not a token cache")
            raise ValueError(f"token cache {path}: {state}; {fix}")
        try:
            self.metadata = json.loads(meta_path.read_text())
        except ValueError as e:
            raise ValueError(f"token cache {meta_path}: not JSON ({e}); {fix}") from None
        m = self.metadata
        if m.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"token cache {path}: format version {m.get('format_version')}, "
                             f"this tfjax reads {FORMAT_VERSION}; {fix} again")
        if split not in SPLITS:
            raise ValueError(f"token cache {path}: split must be one of {SPLITS}, got {split!r}")
        self.tokenizer_name, self.tokenizer_fingerprint = m["tokenizer"], m["tokenizer_fingerprint"]
        self.bos_id, self.eos_id, self.vocab_size = m["bos_id"], m["eos_id"], m["vocab_size"]
        self._dtype = np.dtype(m["dtype"]).newbyteorder("<")
        s = m["splits"][split]
        self.num_documents, self.num_tokens = s["num_documents"], s["num_tokens"]
        if self.num_documents == 0:
            raise ValueError(f"token cache {path}: the {split} split has no documents (1 in 50 "
                             "documents goes to validation by the sha1 rule of their names); "
                             "prepare more documents, or read the train split")
        self.stream_length = self.num_tokens + 2 * self.num_documents
        self._entries = [e for e in s["shards"] if e["num_documents"]]
        sizes = [e["num_tokens"] + 2 * e["num_documents"] for e in self._entries]
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._first_doc = np.concatenate(
            [[0], np.cumsum([e["num_documents"] for e in self._entries])]).astype(np.int64)
        self._open: dict[int, _Shard] = {}

    def _shard(self, i: int) -> _Shard:
        if i not in self._open:
            self._open[i] = _Shard(self._dir, self._entries[i])
        return self._open[i]

    def read(self, start: int, stop: int) -> np.ndarray:
        """[2, stop - start] int32 slice of this split's token stream: row 0 the ids, row 1
        the split-wide index of the document each token belongs to."""
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.stream_length:
            raise ValueError(f"token cache {self.path} ({self.split}): read({start}, {stop}) "
                             f"outside 0 <= start <= stop <= {self.stream_length}")
        out = np.empty((2, stop - start), np.int32)
        pos = start
        i = int(np.searchsorted(self._shard_starts, start, "right")) - 1
        while pos < stop:
            shard, base = self._shard(i), int(self._shard_starts[i])
            lo, hi = pos - base, min(stop, int(self._shard_starts[i + 1])) - base
            first = int(np.searchsorted(shard.starts, lo, "right")) - 1
            last = int(np.searchsorted(shard.starts, hi, "left"))  # exclusive
            at = pos - start
            for d, ids in enumerate(shard.records(first, last, self._dtype), first):
                # document d's part [a, b) in its own positions: 0 is BOS, 1..L its ids,
                # L + 1 EOS; only that part is copied
                s0, L = int(shard.starts[d]), len(ids)
                a, b = max(lo, s0) - s0, min(hi, s0 + L + 2) - s0
                piece = out[0, at:at + b - a]
                if a == 0:
                    piece[0] = self.bos_id
                if b == L + 2:
                    piece[-1] = self.eos_id
                piece[max(a, 1) - a:min(b, L + 1) - a] = ids[max(a, 1) - 1:min(b, L + 1) - 1]
                out[1, at:at + b - a] = d + self._first_doc[i]
                at += b - a
            pos, i = base + hi, i + 1
        return out
