"""The host side (numpy) of the training objectives: what each one makes of packed
rows (`PackedBatches`) or of examples, as arrays `[rows, length]` per key.

MLM masking (`mlm_batch`, `mlm_row`), prefix lengths (`prefix_lm_batch`), T5's span
corruption (`span_corruption_batch`, `span_lengths`) and examples read from jsonl,
parquet or `datasets` inputs (`read_examples`, `ExampleBatches`: classification and
seq2seq rows). Special ids sit above the tokenizer's vocabulary (`special_ids`); every
random choice is drawn from `row_rng(seed, batch, row, salt)`, so resume is exact. See
docs/data.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from etils import epath

from tfjax.config import DataConfig
from tfjax.data.pipeline import RowStreams
from tfjax.data.inputs import find_inputs, read_records
from tfjax.data.sources import is_validation

__all__ = ["ExampleBatches", "MappedBatches", "classification_row", "mlm_row",
           "prefix_lengths", "read_examples", "row_rng", "seq2seq_row", "span_corrupt",
           "span_lengths", "span_noise_mask", "special_ids", "token_bytes_of", "word_units"]

# Salts: the objectives draw from different streams even with one seed.
SALT = dict(mlm=1, prefix_lm=2, span_corruption=3)
WHITESPACE = tuple(b" \t\n\r\x0b\x0c")


def row_rng(seed: int, batch: int, row: int, salt: int) -> np.random.Generator:
    """The generator of one row of one global batch (a pure function of its arguments)."""
    return np.random.default_rng([salt, seed, batch, row])


def special_ids(tokenizer, count: int) -> np.ndarray:
    """The first `count` ids above the tokenizer's vocabulary."""
    return np.arange(tokenizer.vocab_size, tokenizer.vocab_size + count, dtype=np.int32)


def token_bytes_of(tokenizer, ids: np.ndarray) -> np.ndarray:
    """UTF-8 bytes each id stands for; 0 for specials, including the objectives' own."""
    table = tokenizer.token_bytes
    return np.where(ids < len(table), table[np.minimum(ids, len(table) - 1)], 0).astype(np.int32)


class MappedBatches(Iterator[dict]):
    """`inner`'s batches through `fn(batch, batch_index, rows)`, `rows` the global row
    indices of the local rows; the checkpointable state is the inner iterator's."""

    def __init__(self, inner, fn: Callable[[dict, int, list[int]], dict]):
        self.inner, self.fn = inner, fn
        self.local_rows = inner.local_rows

    def get_state(self) -> dict:
        return self.inner.get_state()

    def set_state(self, state: dict) -> None:
        self.inner.set_state(state)

    def num_batches(self) -> int:
        return self.inner.num_batches()

    def data_tokens(self, step: int) -> dict[str, int]:
        return self.inner.data_tokens(step)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        b = self.inner.get_state()["batch"]
        return self.fn(next(self.inner), b, self.local_rows)


# ----------------------------------------------------------------------- MLM
def word_units(tokens: np.ndarray, real: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Unit id per token for whole-word masking (-1: not selectable): a maximal run of
    real non-whitespace byte tokens within one segment is one unit; each real
    whitespace byte is a unit of its own."""
    word = real & ~np.isin(tokens, WHITESPACE)
    prev_word = np.concatenate([[False], word[:-1]])
    same_seg = np.concatenate([[False], segment_ids[1:] == segment_ids[:-1]])
    start = real & ~(word & prev_word & same_seg)
    return np.where(real, np.cumsum(start) - 1, -1)


def mlm_row(tokens: np.ndarray, real: np.ndarray, rng: np.random.Generator, *, rate: float,
            mask_id: int, random_ids: np.ndarray,
            units: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One row: (inputs with the selected tokens corrupted 80/10/10, selected `[T]` bool).
    `units`: a unit id per token (-1: not selectable) for whole-word masking; None =
    every real token is its own unit."""
    T = tokens.shape[0]
    n = int(real.sum())
    selected = np.zeros(T, bool)
    if n:
        want = max(1, int(round(rate * n)))
        if units is None:
            idx = np.flatnonzero(real)
            selected[idx[rng.permutation(n)[:want]]] = True
        else:
            num = int(units.max()) + 1
            sizes = np.bincount(units[units >= 0], minlength=num)
            got = 0
            chosen = np.zeros(num, bool)
            for u in rng.permutation(num):
                if got + sizes[u] > want:
                    continue
                chosen[u] = True
                got += sizes[u]
                if got == want:
                    break
            selected = (units >= 0) & chosen[np.maximum(units, 0)]
    u = rng.random(T)
    rand = random_ids[rng.integers(0, len(random_ids), T)]
    inputs = tokens.copy()
    inputs[selected & (u < 0.8)] = mask_id
    swap = selected & (u >= 0.8) & (u < 0.9)
    inputs[swap] = rand[swap]
    return inputs, selected


def mlm_batch(packed: dict, batch: int, rows: Sequence[int], *, tokenizer, seed: int,
              rate: float, whole_word: bool) -> dict:
    """Packed rows -> MLM arrays: inputs (corrupted), targets (the original tokens),
    positions, segment_ids, mask (selected), target_bytes."""
    tokens, seg = packed["inputs"], packed["segment_ids"]
    real = (token_bytes_of(tokenizer, tokens) > 0) & (seg > 0)
    mask_id = int(special_ids(tokenizer, 1)[0])
    random_ids = np.flatnonzero(tokenizer.token_bytes > 0).astype(np.int32)
    inputs, selected = np.empty_like(tokens), np.zeros(tokens.shape, bool)
    for i, r in enumerate(rows):
        units = word_units(tokens[i], real[i], seg[i]) if whole_word else None
        inputs[i], selected[i] = mlm_row(tokens[i], real[i], row_rng(seed, batch, r, SALT["mlm"]),
                                         rate=rate, mask_id=mask_id, random_ids=random_ids,
                                         units=units)
    mask = selected.astype(np.int32)
    return dict(inputs=inputs, targets=tokens, positions=packed["positions"], segment_ids=seg,
                mask=mask, target_bytes=token_bytes_of(tokenizer, tokens) * mask)


# ----------------------------------------------------------------- prefix LM
def prefix_lengths(segment_ids: np.ndarray, batch: int, rows: Sequence[int], seed: int) -> np.ndarray:
    """Per row, a prefix length uniform in [1, n - 1] (n: the row's real inputs; 1 when
    n < 2)."""
    out = np.ones(len(rows), np.int32)
    for i, r in enumerate(rows):
        n = int((segment_ids[i] > 0).sum())
        if n >= 2:
            out[i] = row_rng(seed, batch, r, SALT["prefix_lm"]).integers(1, n)
    return out


def prefix_lm_batch(packed: dict, batch: int, rows: Sequence[int], *, seed: int) -> dict:
    """Packed LM rows + `prefix_lengths` `[B]`; the targets of prefix positions (t < P - 1:
    their target is itself an input of the bidirectional prefix) are not scored."""
    P = prefix_lengths(packed["segment_ids"], batch, rows, seed)
    keep = np.arange(packed["mask"].shape[1])[None] >= (P[:, None] - 1)
    mask = packed["mask"] * keep
    return dict(packed, mask=mask.astype(np.int32), target_bytes=packed["target_bytes"] * keep,
                prefix_lengths=P)


# ----------------------------------------------------------- span corruption
def span_counts(n: int, density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a row of n >= 2 tokens."""
    noise = min(max(int(round(n * density)), 1), n - 1)
    spans = max(1, int(round(noise / mean_span)))
    return noise, min(spans, n - noise)


def span_lengths(seq_len: int, density: float, mean_span: float) -> tuple[int, int, int]:
    """(raw tokens per row, decoder length, sentinels needed): the longest raw row
    whose encoder input (non-noise + one sentinel per span + EOS) fits `seq_len`, and
    its targets' length (noise + one sentinel per span + EOS)."""
    def enc(n):
        noise, spans = span_counts(n, density, mean_span)
        return n - noise + spans + 1

    n = seq_len
    while enc(n + 1) <= seq_len:
        n += 1
    while n > 2 and enc(n) > seq_len:
        n -= 1
    noise, spans = span_counts(n, density, mean_span)
    # A shorter (final, evaluation) row never needs more sentinels or decoder length.
    return n, noise + spans + 1, spans


def _segmentation(rng: np.random.Generator, items: int, segments: int) -> np.ndarray:
    """`segments` positive lengths summing to `items`, uniformly over the compositions."""
    cuts = np.sort(rng.choice(items - 1, segments - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [items]]))


def span_noise_mask(n: int, rng: np.random.Generator, density: float,
                    mean_span: float) -> np.ndarray:
    """`[n]` bool: T5's random spans noise mask (non-noise span first)."""
    noise, spans = span_counts(n, density, mean_span)
    lengths = np.stack([_segmentation(rng, n - noise, spans),
                        _segmentation(rng, noise, spans)], 1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), lengths)


def span_corrupt(tokens: np.ndarray, noise: np.ndarray, sentinels: np.ndarray,
                 eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(encoder input, targets): span i of `noise` becomes `sentinels[i]` in the input;
    the targets are sentinel i + span i, for each span; both end with `eos`."""
    prev = np.concatenate([[False], noise[:-1]])
    first = noise & ~prev
    span = np.cumsum(first) - 1
    inputs = np.where(first, sentinels[np.maximum(span, 0)], tokens)[~(noise & prev)]
    body = tokens[noise]
    targets = np.insert(body, np.flatnonzero(first[noise]), sentinels[: int(first.sum())])
    return (np.concatenate([inputs, [eos]]).astype(np.int32),
            np.concatenate([targets, [eos]]).astype(np.int32))


def _pad(x: np.ndarray, n: int, fill: int) -> np.ndarray:
    out = np.full(n, fill, np.int32)
    out[: len(x)] = x[:n]
    return out


def _encdec_row(enc: list[np.ndarray], tgt: list[np.ndarray], S: int, Td: int, pad: int,
                start: int, token_bytes) -> dict:
    """Examples (encoder ids, target ids) laid side by side into one row: segment k + 1
    and positions from 0 for example k on both sides; decoder inputs = start + targets
    shifted right, within each example."""
    def lay(pieces, n):
        ids = np.full(n, pad, np.int32)
        seg, pos = np.zeros(n, np.int32), np.zeros(n, np.int32)
        at = 0
        for k, p in enumerate(pieces):
            ids[at:at + len(p)], seg[at:at + len(p)] = p, k + 1
            pos[at:at + len(p)] = np.arange(len(p))
            at += len(p)
        return ids, seg, pos

    e, es, ep = lay(enc, S)
    t, ts, tp = lay(tgt, Td)
    d, _, _ = lay([np.concatenate([[start], p[:-1]]) for p in tgt], Td)
    mask = (ts > 0).astype(np.int32)
    return dict(encoder_inputs=e, encoder_segment_ids=es, encoder_positions=ep,
                decoder_inputs=d, decoder_segment_ids=ts, decoder_positions=tp, targets=t,
                mask=mask, target_bytes=token_bytes(t) * mask)


ENCDEC_KEYS = ("encoder_inputs", "encoder_segment_ids", "encoder_positions", "decoder_inputs",
               "decoder_segment_ids", "decoder_positions", "targets", "mask", "target_bytes")


def span_corruption_batch(packed: dict, batch: int, rows: Sequence[int], *, tokenizer,
                          seed: int, density: float, mean_span: float, seq_len: int,
                          target_len: int, num_sentinels: int) -> dict:
    """Packed rows of raw tokens (`packed["inputs"]`, the real ones first) -> encoder /
    decoder arrays (`ENCDEC_KEYS`); a row with fewer than 2 real tokens is empty."""
    sentinels = special_ids(tokenizer, num_sentinels)
    out = []
    for i, r in enumerate(rows):
        n = int((packed["segment_ids"][i] > 0).sum())
        enc, tgt = [], []
        if n >= 2:
            noise = span_noise_mask(n, row_rng(seed, batch, r, SALT["span_corruption"]),
                                    density, mean_span)
            e, t = span_corrupt(packed["inputs"][i][:n], noise, sentinels, tokenizer.eos_id)
            enc, tgt = [e], [t]
        out.append(_encdec_row(enc, tgt, seq_len, target_len, tokenizer.pad_id,
                               tokenizer.pad_id, lambda x: token_bytes_of(tokenizer, x)))
    return {k: np.stack([o[k] for o in out]) for k in ENCDEC_KEYS}


# ------------------------------------------------------------------ examples
def _check_field(where: str, rec: dict, name: str, kind: str, num_classes: int) -> None:
    v = rec.get(name)
    if kind == "text" and not (isinstance(v, str) and v.strip()):
        raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {v!r}")
    if kind == "file" and not (isinstance(v, bytes) and v or isinstance(v, str) and v.strip()):
        raise ValueError(f"{where}: field {name!r} must be a path (relative to this file) or "
                         f"the file's bytes (a parquet binary column), got {type(v).__name__}")
    if kind == "label" and (isinstance(v, bool) or not isinstance(v, int)
                            or not 0 <= v < num_classes):
        raise ValueError(f"{where}: field {name!r} must be an integer class in [0, "
                         f"{num_classes}) (model.num_classes={num_classes}), got {v!r}")


def _beside(inp, value):
    """A relative path in input `inp` -> the path beside its file (inside a `datasets`
    directory); bytes and absolute paths as given."""
    if isinstance(value, bytes) or "://" in value or epath.Path(value).is_absolute():
        return value
    base = epath.Path(inp.path)
    return str((base if inp.kind == "dataset" else base.parent) / value)


def read_examples(cfg: DataConfig, split: str, fields: dict[str, str],
                  num_classes: int = 0, where: bool = False) -> list[dict]:
    """The examples of `split` from `data.paths` / `data.val_paths` (files, globs,
    directories, local or on a bucket; the split rule of `tfjax.data.sources`): one dict
    with `fields` (name -> "text", "label" or "file") per record, each input read by its kind
    as `tfjax.data.prepare` reads it (`read_records`): JSON lines (.jsonl, any other
    file), a .json list, the columns of a .parquet file or of a Hugging Face `datasets`
    directory. Every record is checked: an object whose text fields are non-empty
    strings, whose label is an integer in [0, num_classes) and whose file is a path
    (relative to the input's directory, or a `datasets` directory itself; returned
    resolved) or bytes, or a one-line ValueError
    naming the file, the line (1-based) or row (0-based) and the field; a parquet file
    or dataset without a field's column names the file and the column. `where`: each
    example also holds "where", its "file:line" / "file: row r" (for later errors)."""
    names = ", ".join(fields)
    if cfg.source != "jsonl":
        raise ValueError(f"data.source: {cfg.source!r}; this objective reads examples with "
                         f"fields {names} from jsonl, parquet or Hugging Face datasets inputs: "
                         f"set data.source='jsonl' and data.paths")
    explicit = bool(cfg.val_paths)
    if split == "validation" and explicit:
        patterns, field, rule = cfg.val_paths, "data.val_paths", None
    else:
        patterns, field, rule = cfg.paths, "data.paths", (None if explicit else split)
    fix = f"these examples need columns {names}: rename the column or point {field} elsewhere"
    out = []
    for inp in find_inputs(patterns, field):
        for key, at, rec in read_records(inp, tuple(fields), fix=fix):
            if not isinstance(rec, dict):
                raise ValueError(f"{at}: expected a JSON object with fields {names}")
            for name, kind in fields.items():
                _check_field(at, rec, name, kind, num_classes)
            if rule is None or is_validation(key) == (rule == "validation"):
                out.append({name: _beside(inp, rec[name]) if kind == "file" else rec[name]
                            for name, kind in fields.items()})
                if where:
                    out[-1]["where"] = at
    if not out:
        raise ValueError(f"data.paths: the {split} split has no examples (data.paths="
                         f"{cfg.paths!r}, data.val_paths={cfg.val_paths!r}); 1 in 50 records goes "
                         f"to validation unless data.val_paths names files")
    return out


def classification_row(examples: list[dict], seq_len: int, tokenizer) -> dict:
    """One example per row: `[bos] + text + [eos]` truncated to `seq_len`, `labels`,
    `mask` 1 (0 for an empty row)."""
    if not examples:
        z = np.zeros(seq_len, np.int32)
        return dict(inputs=np.full(seq_len, tokenizer.pad_id, np.int32), segment_ids=z,
                    positions=z, labels=np.int32(0), mask=np.int32(0))
    (ex,) = examples
    ids = np.concatenate([[tokenizer.bos_id], ex["ids"][: seq_len - 2], [tokenizer.eos_id]])
    seg = _pad(np.ones(len(ids), np.int32), seq_len, 0)
    return dict(inputs=_pad(ids, seq_len, tokenizer.pad_id), segment_ids=seg,
                positions=np.arange(seq_len, dtype=np.int32), labels=np.int32(ex["label"]),
                mask=np.int32(1))


def seq2seq_row(examples: list[dict], seq_len: int, target_len: int, tokenizer) -> dict:
    return _encdec_row([e["enc"] for e in examples], [e["tgt"] for e in examples], seq_len,
                       target_len, tokenizer.pad_id, tokenizer.pad_id,
                       lambda x: token_bytes_of(tokenizer, x))


class ExampleBatches(RowStreams):
    """Rows of examples: row r of every global batch reads examples r, r + B, r + 2B, ...
    of the (shuffled, repeated) order, its stream, taking the next ones while
    `fits(taken, next)` (`fits=None`: one per row). The state is one (example, 0)
    cursor per stream, as `PackedBatches`'. repeat=False: exhausted streams give
    empty rows and the iterator stops after `num_batches()` batches."""

    def __init__(self, examples: Sequence[dict], encode: Callable[[dict], dict],
                 make_row: Callable[[list[dict]], dict], *, global_batch: int,
                 local_rows: Sequence[int] | None = None, seed: int = 0, shuffle: bool = True,
                 repeat: bool = True, fits: Callable[[list[dict], dict], bool] | None = None):
        self._n = len(examples)
        self._start(list(examples), encode, global_batch=global_batch, local_rows=local_rows,
                    seed=seed, shuffle=shuffle, repeat=repeat)
        self._ex = self._items
        self.make_row, self.fits = make_row, fits

    def _take(self, r: int, j: int) -> tuple[list[dict], int]:
        """The examples row r takes from stream position j, and the next position."""
        taken: list[dict] = []
        while self.repeat or r + j * self.global_batch < self._n:
            ex = self._ex[r + j * self.global_batch]
            if taken and (self.fits is None or not self.fits(taken, ex)):
                break
            taken.append(ex)
            j += 1
            if self.fits is None:
                break
        return taken, j

    def num_batches(self) -> int:
        if self.repeat:
            raise ValueError("an endless (repeat=True) stream has no number of batches")
        if self._num_batches is None:
            longest = 0
            for r in range(min(self.global_batch, self._n)):
                j = rows = 0
                while r + j * self.global_batch < self._n:
                    _, j = self._take(r, j)
                    rows += 1
                longest = max(longest, rows)
            self._num_batches = longest
        return self._num_batches

    def __next__(self) -> dict:
        if not self.repeat and self._state["batch"] >= self.num_batches():
            raise StopIteration
        rows = []
        for r in self.local_rows:
            cursor = self._state["cursors"][r]
            taken, cursor[0] = self._take(r, cursor[0])
            rows.append(self.make_row(taken))
        self._state["batch"] += 1
        return {k: np.stack([row[k] for row in rows]) for k in rows[0]}


def fits_both(seq_len: int, target_len: int) -> Callable[[list[dict], dict], bool]:
    """Seq2seq packing: the next example joins the row while both sides still fit."""
    def fits(taken, ex):
        return (sum(len(e["enc"]) for e in taken) + len(ex["enc"]) <= seq_len
                and sum(len(e["tgt"]) for e in taken) + len(ex["tgt"]) <= target_len)
    return fits


def round_up(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)
