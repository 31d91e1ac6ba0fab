"""A block-deterministic mixture of prepared token caches (`data.source="cache"`).

Each cache's stream is cut into rows of `seq_len + 1` tokens (row i: positions
[i*seq_len, i*seq_len + seq_len + 1)). Global row g = step * global_batch + r; rows
come in blocks of `block_rows`, each block taking fixed counts from every source
(largest remainder of the stage's weights) at seeded places; the j-th draw of source
s is its row `perm_s(j mod rows_s)`, a fresh lazy grain permutation each pass. Stages
restart the blocks and carry the draw counts over, so every row is a pure function
of (step, row): random access and exact resume (the state is the batch counter).
`MixtureBatches` yields `tfjax.data.pipeline.BATCH_KEYS` rows for `local_rows` only.
See docs/data.md ("Mixtures and stages").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grain
import numpy as np

from tfjax import storage
from tfjax.config import DataConfig
from tfjax.data.cache import TokenCache
from tfjax.data.pipeline import BATCH_KEYS, empty_row, row_batch

__all__ = ["MixtureBatches", "MixturePlan", "block_counts", "check_caches", "open_cache",
           "open_caches"]


def open_cache(path: str, split: str):
    """One split of a prepared cache directory (tests put an in-memory stand-in here)."""
    return TokenCache(path, split)


def open_caches(data: DataConfig, split: str) -> list:
    """The `split` of every cache `data.paths` names. A missing or unfinished directory,
    an empty train split or two caches with one directory name (the `data_tokens/<name>`
    log) fail naming the field. A cache without a validation split is left out of the
    validation pass; none with one is an error."""
    caches, errors = [], []
    for i, path in enumerate(data.paths):
        storage.check_reachable(path, f"data.paths[{i}]")  # a bucket: one line, naming it
        try:
            caches.append(open_cache(path, split))
        except ValueError as e:
            if split == "train":
                raise ValueError(f"data.paths[{i}]: {e}") from None
            errors.append(f"data.paths[{i}]: {e}")
    if split == "train":
        names = [c.name for c in caches]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.paths: two caches share the directory name "
                             f"{', '.join(map(repr, twice))}, which names them in the "
                             f"data_tokens/<name> log; give each cache its own directory name")
    if not caches:
        raise ValueError(f"data.paths: no cache has a {split} split ({'; '.join(errors)}); "
                         f"prepare caches with documents in it")
    return caches


def check_caches(caches: Sequence, tokenizer, tokenizer_name: str) -> None:
    """Every cache was made with the run's tokenizer (their fingerprints agree)."""
    for c in caches:
        if c.tokenizer_fingerprint != tokenizer.fingerprint:
            raise ValueError(
                f"data.paths: {c.path} was prepared with tokenizer {c.tokenizer_name!r}, but "
                f"data.tokenizer={tokenizer_name!r} encodes differently (fingerprints "
                f"{c.tokenizer_fingerprint[:12]} != {tokenizer.fingerprint[:12]}); set "
                f"data.tokenizer to the cache's tokenizer, or re-run prepare with "
                f"--tokenizer {tokenizer_name}")


def block_counts(weights: Sequence[float], block_rows: int) -> tuple[int, ...]:
    """Rows of each source in one block: the largest-remainder rounding of
    `weights / sum(weights) * block_rows` (exact sum; ties to the earlier source)."""
    w = np.asarray(weights, np.float64)
    if len(w) == 0 or (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"data.weights: {tuple(weights)} must be finite, >= 0 and sum to > 0")
    ideal = w / w.sum() * block_rows
    counts = np.floor(ideal).astype(np.int64)
    short = block_rows - int(counts.sum())
    order = sorted(range(len(w)), key=lambda s: (-(ideal[s] - counts[s]), s))
    counts[order[:short]] += 1
    return tuple(int(c) for c in counts)


# A source pass's permutation is held in memory (int32) up to this many rows; grain's
# O(1)-memory index shuffle serves larger sources (it is fast there, slow on small ones).
PERMUTED_ROWS = 1 << 22


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([p % 2**32 for p in parts]).generate_state(1)[0])


class MixturePlan:
    """Which source row every global row reads. rows: rows per source; stages:
    `(start_step, weights)` pairs, the first at step 0."""

    def __init__(self, rows: Sequence[int], stages: Sequence[tuple[int, Sequence[float]]], *,
                 global_batch: int, block_rows: int, seed: int = 0, shuffle: bool = True):
        self.rows, self.global_batch, self.block_rows = tuple(rows), global_batch, block_rows
        self.seed, self.shuffle = seed, shuffle
        self.starts = [int(s) for s, _ in stages]
        if self.starts[0] != 0 or any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"data.stages: start steps {self.starts[1:]} must be increasing "
                             f"and after step 0")
        self.counts = [np.asarray(block_counts(w, block_rows)) for _, w in stages]
        for w in (w for _, w in stages):
            if len(w) != len(self.rows):
                raise ValueError(f"data.weights: {len(w)} weight(s) for {len(self.rows)} caches")
        self._blocks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._passes: dict[tuple[int, int], np.ndarray] = {}
        self._base = [np.zeros(len(self.rows), np.int64)]  # draws before each stage
        for k in range(len(self.starts) - 1):
            span = (self.starts[k + 1] - self.starts[k]) * global_batch
            self._base.append(self._base[k] + self._within(k, span))

    def _block(self, k: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b of stage k: each place's source and its rank among that source's."""
        if (k, b) not in self._blocks:
            n, counts = self.block_rows, self.counts[k]
            if self.shuffle:
                slot = np.random.default_rng(_seed(self.seed, 1, k, b)).permutation(n)
            else:
                slot = np.arange(n)
            src = np.repeat(np.arange(len(counts)), counts)[slot]
            rank = slot - (np.cumsum(counts) - counts)[src]
            if len(self._blocks) >= 4:
                self._blocks.clear()
            self._blocks[(k, b)] = src, rank
        return self._blocks[(k, b)]

    def _within(self, k: int, q: int) -> np.ndarray:
        """Draws of each source in the first q rows of stage k."""
        b, p = divmod(q, self.block_rows)
        part = np.bincount(self._block(k, b)[0][:p], minlength=len(self.rows)) if p else 0
        return b * self.counts[k] + part

    def _stage(self, step: int) -> int:
        return int(np.searchsorted(self.starts, step, side="right")) - 1

    def draws(self, step: int) -> np.ndarray:
        """Rows drawn from each source in steps [0, step) (exact)."""
        k = self._stage(step)
        return self._base[k] + self._within(k, (step - self.starts[k]) * self.global_batch)

    def source_row(self, step: int, r: int) -> tuple[int, int]:
        """(source, its row) of row r of the global batch at `step`."""
        k = self._stage(step)
        b, p = divmod((step - self.starts[k]) * self.global_batch + r, self.block_rows)
        src, rank = self._block(k, b)
        s = int(src[p])
        j = int(self._base[k][s]) + b * int(self.counts[k][s]) + int(rank[p])
        return s, self._order(s, j)

    def _order(self, s: int, j: int) -> int:
        """Source s's row of its j-th draw: pass j // rows of it, each pass a fresh seeded
        permutation (held in memory up to `PERMUTED_ROWS` rows; beyond, grain's index
        shuffle, O(1) in memory)."""
        n = self.rows[s]
        if not self.shuffle:
            return j % n
        p, i = divmod(j, n)
        if n > PERMUTED_ROWS:
            return int(grain.experimental.index_shuffle(i, max_index=n - 1, rounds=4,
                                                        seed=_seed(self.seed, 0, s, p)))
        if (s, p) not in self._passes:
            if len(self._passes) >= 2 * len(self.rows):
                self._passes.clear()
            rng = np.random.default_rng(_seed(self.seed, 0, s, p))
            self._passes[s, p] = rng.permutation(n).astype(np.int32)
        return int(self._passes[s, p][i])


class MixtureBatches(Iterator[dict]):
    """`PackedBatches`' interface over token caches: `[len(local_rows), seq_len]` int32
    `BATCH_KEYS` batches; the state is the batch counter. repeat=True: the weighted,
    staged mixture of the caches' full rows (weights () = proportional to each cache's
    tokens). repeat=False: every row of every cache once, in order, the last row of each
    padded, for `num_batches()` batches (validation)."""

    def __init__(self, caches: Sequence, tokenizer, *, seq_len: int, global_batch: int,
                 local_rows: Sequence[int] | None = None, weights: Sequence[float] = (),
                 stages: Sequence[tuple[int, Sequence[float]]] = (), block_rows: int = 2048,
                 seed: int = 0, shuffle: bool = True, repeat: bool = True):
        self.caches, self.tokenizer, self.seq_len = list(caches), tokenizer, seq_len
        self.global_batch, self.repeat = global_batch, repeat
        self.local_rows = list(range(global_batch)) if local_rows is None else sorted(local_rows)
        self._batch = 0
        T = seq_len
        if repeat:
            rows = [(c.stream_length - 1) // T for c in self.caches]
            for c, n in zip(self.caches, rows):
                if n == 0:
                    raise ValueError(f"data.paths: {c.path} holds {c.stream_length} tokens, "
                                     f"fewer than one row of seq_len + 1 = {T + 1}; prepare "
                                     f"more documents or lower train.seq_len")
            first = tuple(weights) or tuple(c.num_tokens for c in self.caches)
            self.plan = MixturePlan(rows, [(0, first), *stages], global_batch=global_batch,
                                    block_rows=block_rows, seed=seed, shuffle=shuffle)
        else:
            rows = [-(-(c.stream_length - 1) // T) for c in self.caches]
            self._first_row = np.cumsum([0, *rows])  # of each cache in the pass

    def data_tokens(self, step: int) -> dict[str, int]:
        """`data_tokens/<cache name>`: the tokens (targets) drawn from each cache in steps
        [0, step): its rows drawn x seq_len, consecutive rows sharing one token."""
        if not self.repeat:
            return {}
        return {f"data_tokens/{c.name}": int(n) * self.seq_len
                for c, n in zip(self.caches, self.plan.draws(step))}

    def num_batches(self) -> int:
        """Batches in the validation pass (repeat=False)."""
        if self.repeat:
            raise ValueError("an endless (repeat=True) stream has no number of batches")
        return -(-int(self._first_row[-1]) // self.global_batch)

    def get_state(self) -> dict:
        return dict(batch=self._batch)

    def set_state(self, state: dict) -> None:
        batch = state.get("batch") if isinstance(state, dict) else None
        if "cursors" in (state or {}) or not isinstance(batch, int) or batch < 0:
            raise ValueError(f"data state {str(state)[:60]} is not a cache mixture's batch "
                             f"counter; resume with the data config it was saved with")
        self._batch = batch

    def __iter__(self):
        return self

    def _row(self, cache, i: int) -> dict:
        """Row i of one cache: stream positions [i*T, i*T + T + 1), padded past its end."""
        T = self.seq_len
        start = i * T
        got = cache.read(start, min(start + T + 1, cache.stream_length))
        n = got.shape[1]
        toks = np.full(T + 1, self.tokenizer.pad_id, np.int32)
        toks[:n] = got[0]
        doc = got[1]
        new = np.concatenate([[True], doc[1:] != doc[:-1]])
        seg = np.zeros(T + 1, np.int32)
        seg[:n] = np.cumsum(new)
        starts = np.flatnonzero(new)
        pos = np.zeros(T + 1, np.int32)
        pos[:n] = np.arange(n) - starts[seg[:n] - 1]
        return row_batch(self.tokenizer, toks, seg, pos, (seg > 0).astype(np.int32))

    def __next__(self) -> dict:
        b, B = self._batch, self.global_batch
        rows = []
        if self.repeat:
            for r in self.local_rows:
                s, i = self.plan.source_row(b, r)
                rows.append(self._row(self.caches[s], i))
        else:
            if b >= self.num_batches():
                raise StopIteration
            for r in self.local_rows:
                v = b * B + r
                if v >= self._first_row[-1]:
                    rows.append(empty_row(self.tokenizer, self.seq_len))
                    continue
                s = int(np.searchsorted(self._first_row, v, side="right")) - 1
                rows.append(self._row(self.caches[s], v - int(self._first_row[s])))
        self._batch += 1
        return {k: np.stack([row[k] for row in rows]) for k in BATCH_KEYS}
