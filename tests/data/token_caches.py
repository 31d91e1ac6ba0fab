"""Token caches for tests: `prepared_cache` writes a real one (`tfjax.data.prepare`) of
given documents; `MemoryCache` is an in-memory stand-in for `tfjax.data.cache.TokenCache`
(its protocol: path, name, split, tokenizer_*, num_tokens, stream_length, read) for the
mixture's unit tests, which count its reads and need many small caches fast."""

from __future__ import annotations

import os

import numpy as np

from tfjax.data.prepare import prepare
from tfjax.data.sources import is_validation


class MemoryCache:
    """One split of a cache: documents (lists of ids) -> the stream `[bos] + ids + [eos]`
    per document, and the document index of every token. `reads` records each
    `read(start, stop)`."""

    def __init__(self, docs, tokenizer, *, path="mem/a", split="train", tokenizer_name="byte",
                 fingerprint=None):
        if not docs:
            raise ValueError(f"{path}: the {split} split is empty; prepare more documents")
        self.path, self.name, self.split = path, os.path.basename(path.rstrip("/")), split
        self.metadata = {}
        self.tokenizer_name = tokenizer_name
        self.tokenizer_fingerprint = fingerprint or tokenizer.fingerprint
        self.bos_id, self.eos_id = tokenizer.bos_id, tokenizer.eos_id
        self.vocab_size = tokenizer.vocab_size
        self.num_documents = len(docs)
        self.num_tokens = sum(len(d) for d in docs)
        ids = np.concatenate([[self.bos_id, *d, self.eos_id] for d in docs]).astype(np.int32)
        doc = np.concatenate([np.full(len(d) + 2, i) for i, d in enumerate(docs)]).astype(np.int32)
        self._stream = np.stack([ids, doc])
        self.stream_length = self._stream.shape[1]
        self.reads: list[tuple[int, int]] = []

    def read(self, start: int, stop: int) -> np.ndarray:
        assert 0 <= start <= stop <= self.stream_length, (start, stop, self.stream_length)
        self.reads.append((start, stop))
        return self._stream[:, start:stop].copy()


def memory_caches(monkeypatch, tokenizer, corpora: dict, **kw) -> dict:
    """Point `tfjax.data.mixture.open_cache` at in-memory caches: corpora maps a path to
    {split: docs}; a path not in it is a missing directory. Returns the opened caches
    by (path, split), so tests can count their reads."""
    from tfjax.data import mixture

    opened = {}

    def open_cache(path, split):
        if path not in corpora:
            raise ValueError(f"{path}: no metadata.json; run python -m tfjax.data.prepare "
                             f"... --output {path} first")
        opened[path, split] = MemoryCache(corpora[path].get(split, []), tokenizer, path=path,
                                          split=split, **kw)
        return opened[path, split]

    monkeypatch.setattr(mixture, "open_cache", open_cache)
    return opened


def prepared_cache(path, splits: dict, tokenizer: str = "byte", src=None) -> str:
    """A real token cache at `path` of `splits` ({split: docs}, each document a list of
    byte values 1..255 for the byte tokenizer): each document a text file in `src`
    (default `path`.src; local), named so that the validation rule (`is_validation`)
    puts it in its split."""
    src, out = str(src or f"{path}.src"), str(path)
    os.makedirs(src)
    k = 0
    for split, docs in splits.items():
        for doc in docs:
            while is_validation(f"d{k:05d}.txt") != (split == "validation"):
                k += 1
            with open(os.path.join(src, f"d{k:05d}.txt"), "wb") as f:
                f.write(bytes(int(t) for t in doc))
            k += 1
    prepare([src], out, tokenizer=tokenizer, workers=1, progress=False)
    return out
