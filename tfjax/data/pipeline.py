"""The input pipeline: documents -> tokens -> packed rows -> this process's share of
each global batch, with an iterator state small enough to checkpoint as JSON.

`PackedBatches(source, tokenizer, seq_len=, global_batch=, local_rows=)` yields
`BATCH_KEYS` arrays `[len(local_rows), seq_len]` int32: documents `[bos] + tokens +
[eos]` laid end to end, each piece with its own segment id and positions from 0, and
`mask` 0 on a target that crosses a document or is not scored (an instruction
prompt). Row r of every batch reads its own stream of the shuffled documents; the
state is one (document, offset) cursor per stream. See docs/data.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grain
import numpy as np

from tfjax.data.sources import DocumentSource

__all__ = ["BATCH_KEYS", "PackedBatches", "RowStreams", "empty_row", "encode_item", "row_batch"]

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "mask", "target_bytes")


def encode_item(tokenizer, item) -> np.ndarray:
    """One source item -> `[2, n]` int32: the ids `[bos] + ... + [eos]` and whether each
    is scored as a target. A document (str / bytes) is scored throughout; a `(prompt,
    completion)` pair only on the completion and its EOS."""
    bos, eos = [tokenizer.bos_id], [tokenizer.eos_id]
    if isinstance(item, tuple):
        prompt, completion = (tokenizer.encode(x) for x in item)
        ids = np.concatenate([bos, prompt, completion, eos])
        scored = np.concatenate([np.zeros(1 + len(prompt)), np.ones(len(completion) + 1)])
    else:
        ids = np.concatenate([bos, tokenizer.encode(item), eos])
        scored = np.ones(len(ids))
    return np.stack([ids, scored]).astype(np.int32)


def row_batch(tokenizer, toks: np.ndarray, seg: np.ndarray, pos: np.ndarray,
              score: np.ndarray) -> dict:
    """One packed row of `T + 1` tokens (segment ids from 1 per document piece, 0 on
    padding; positions from 0 per piece; whether each token is scored) -> the `BATCH_KEYS`
    arrays `[T]`: `mask` 0 where the target crosses a piece, is padding or not scored."""
    T = len(toks) - 1
    mask = (seg[:T] == seg[1:]) & (seg[:T] > 0) & (score[1:] > 0)
    targets = toks[1:]
    tb = tokenizer.token_bytes[np.minimum(targets, len(tokenizer.token_bytes) - 1)]
    return dict(inputs=toks[:T], targets=targets, positions=pos[:T], segment_ids=seg[:T],
                mask=mask.astype(np.int32), target_bytes=(tb * mask).astype(np.int32))


def empty_row(tokenizer, T: int) -> dict:
    """A row of padding (nothing scored): the end of a non-repeating pass."""
    z = np.zeros(T, np.int32)
    return dict(inputs=np.full(T, tokenizer.pad_id, np.int32),
                targets=np.full(T, tokenizer.pad_id, np.int32),
                positions=z, segment_ids=z, mask=z, target_bytes=z)


class RowStreams(Iterator[dict]):
    """The part every per-row streaming iterator shares: row r of every global batch
    reads items r, r + B, r + 2B, ... of one (shuffled, repeated) order, and the
    checkpointable state is one [item, offset] cursor per row plus the batch count
    (JSON). Subclasses call `_start` and implement `__next__`."""

    def _start(self, items, transform, *, global_batch: int, local_rows, seed: int,
               shuffle: bool, repeat: bool) -> None:
        self.global_batch, self.repeat = global_batch, repeat
        self.local_rows = list(range(global_batch)) if local_rows is None else sorted(local_rows)
        ds = grain.MapDataset.source(items)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        if repeat:
            ds = ds.repeat()
        self._items = ds.map(transform)
        self._num_batches: int | None = None
        self._state = dict(cursors=[[0, 0] for _ in range(global_batch)], batch=0)

    def get_state(self) -> dict:
        return dict(cursors=[list(c) for c in self._state["cursors"]], batch=self._state["batch"])

    def set_state(self, state: dict) -> None:
        cursors = [[int(j), int(o)] for j, o in state["cursors"]]
        if len(cursors) != self.global_batch:
            raise ValueError(f"data state has {len(cursors)} streams but train.batch_size is "
                             f"{self.global_batch}; resume with the batch size it was saved with")
        self._state = dict(cursors=cursors, batch=int(state["batch"]))

    def data_tokens(self, step: int) -> dict[str, int]:
        """Tokens drawn per source after `step` steps, for the log: none here (one
        source); the cache mixture (`tfjax.data.mixture`) names each cache."""
        return {}

    def __iter__(self):
        return self


class PackedBatches(RowStreams):
    """Batches `{inputs, targets, positions, segment_ids, mask, target_bytes}` of shape
    `[len(local_rows), seq_len]` (int32): the rows `local_rows` of each global batch.

    repeat=False reads the documents once (evaluation): exhausted streams give empty
    rows (mask 0) and the iterator stops after `num_batches()` batches, a number every
    process computes alike.
    """

    def __init__(self, source: DocumentSource, tokenizer, *, seq_len: int, global_batch: int,
                 local_rows: Sequence[int] | None = None, seed: int = 0, shuffle: bool = True,
                 repeat: bool = True):
        self.seq_len, self.tokenizer = seq_len, tokenizer
        self._num_docs = len(source)
        self._start(source, lambda item: encode_item(tokenizer, item), global_batch=global_batch,
                    local_rows=local_rows, seed=seed, shuffle=shuffle, repeat=repeat)
        self._docs = self._items
        self._cache: dict[int, tuple[int, np.ndarray]] = {}

    # -- packing -------------------------------------------------------------
    def _doc(self, r: int, j: int) -> np.ndarray | None:
        """Document j of stream r (None past the end when not repeating)."""
        k = r + j * self.global_batch
        if not self.repeat and k >= self._num_docs:
            return None
        cached = self._cache.get(r)
        if cached is None or cached[0] != k:
            self._cache[r] = cached = (k, self._docs[k])
        return cached[1]

    def num_batches(self) -> int:
        """Batches in one pass (repeat=False): the longest stream decides."""
        if self.repeat:
            raise ValueError("an endless (repeat=True) stream has no number of batches")
        if self._num_batches is None:
            longest = 0
            for r in range(self.global_batch):
                n = sum(self._docs[k].shape[1]
                        for k in range(r, self._num_docs, self.global_batch))
                longest = max(longest, -(-(n - 1) // self.seq_len) if n > 1 else 0)
            self._num_batches = longest
        return self._num_batches

    def _next_row(self, r: int) -> tuple[np.ndarray, ...] | None:
        need = self.seq_len + 1
        toks = np.full(need, self.tokenizer.pad_id, np.int32)
        score = np.zeros(need, np.int32)
        seg = np.zeros(need, np.int32)
        pos = np.zeros(need, np.int32)
        cursor = self._state["cursors"][r]
        j, o = cursor
        filled, piece, last = 0, 0, None
        while filled < need:
            doc = self._doc(r, j)
            if doc is None:
                break
            n = min(doc.shape[1] - o, need - filled)
            toks[filled:filled + n] = doc[0, o:o + n]
            score[filled:filled + n] = doc[1, o:o + n]
            piece += 1
            seg[filled:filled + n] = piece
            pos[filled:filled + n] = np.arange(n)
            filled += n
            last = (j, o + n)
            j, o = (j + 1, 0) if o + n == doc.shape[1] else (j, o + n)
        if filled <= 1 and not self.repeat:  # nothing left to predict
            cursor[:] = [j, o]
            return None
        if filled == need:  # the next row starts on this row's last token
            cursor[:] = [last[0], last[1] - 1]
        else:
            cursor[:] = [j, 0]
        return toks, seg, pos, score

    def __next__(self) -> dict:
        if not self.repeat and self._state["batch"] >= self.num_batches():
            raise StopIteration
        rows = []
        for r in self.local_rows:
            row = self._next_row(r)
            rows.append(row_batch(self.tokenizer, *row) if row is not None
                        else empty_row(self.tokenizer, self.seq_len))
        self._state["batch"] += 1
        return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}
