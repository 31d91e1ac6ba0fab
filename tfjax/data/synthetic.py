"""Synthetic sequence tasks for probing what an architecture can do at tiny scale
(`TASKS`: mqar, selective_copy, induction_heads, passkey, delayed_copy).

Every generator is seeded numpy (`seed`: an int or a `np.random.Generator`) and returns

    tokens    [B, T] int32   the model's input
    targets   [B, T] int32   what the model should output at each position
    loss_mask [B, T] bool    True exactly at the task's answer positions

Token 0 is PAD in every task. See docs/data.md for the tasks' vocabulary layouts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = [
    "PAD",
    "TASKS",
    "delayed_copy",
    "induction_heads",
    "masked_accuracy",
    "mqar",
    "passkey",
    "selective_copy",
]

PAD = 0

# selective_copy
BLANK, COPY_MARKER, COPY_DATA0 = 1, 2, 3
# induction_heads
TRIGGER, INDUCTION_CONTENT0 = 1, 2
# passkey
NEEDLE_MARKER, QUERY_MARKER, DIGIT0, FILLER0 = 1, 2, 3, 13


def _rng(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _next_token(tokens: np.ndarray, answer: np.ndarray):
    """targets = tokens shifted left (last = PAD); loss_mask = answer positions."""
    targets = np.full_like(tokens, PAD)
    targets[:, :-1] = tokens[:, 1:]
    return tokens.astype(np.int32), targets.astype(np.int32), answer.astype(bool)


def _choose(rng: np.random.Generator, B: int, n: int, k: int) -> np.ndarray:
    """[B, k] distinct indices in [0, n) per row (uniform random subsets, random order)."""
    return np.argsort(rng.random((B, n)), axis=1)[:, :k]


def mqar(seed, *, batch: int, seq_len: int, num_pairs: int, vocab_size: int,
         num_queries: int | None = None):
    """Multi-query associative recall (Zoology): `num_pairs` key-value pairs, then
    `num_queries` (default `num_pairs`) of those keys, each to be answered by its value."""
    B = _check_int("batch", batch, 1)
    T = _check_int("seq_len", seq_len, 1)
    P = _check_int("num_pairs", num_pairs, 1)
    V = _check_int("vocab_size", vocab_size, 1)
    Q = P if num_queries is None else _check_int("num_queries", num_queries, 1)
    K = (V - 1) // 2
    if P > K:
        raise ValueError(f"vocab_size={V} too small for num_pairs={P}: keys are drawn without "
                         f"replacement from (vocab_size - 1) // 2 = {K} tokens; use "
                         f"vocab_size >= {2 * P + 1}")
    if Q > P:
        raise ValueError(f"num_queries={Q} > num_pairs={P}: each query asks a distinct key")
    if T < 2 * P + 2 * Q:
        raise ValueError(f"seq_len={T} too short for num_pairs={P} and num_queries={Q}: the "
                         f"pairs take {2 * P} tokens and each query 2 more; use seq_len >= "
                         f"{2 * P + 2 * Q}")
    rng = _rng(seed)
    keys = 1 + _choose(rng, B, K, P)  # [B, P] distinct per row
    values = rng.integers(1 + K, V, size=(B, P))
    tokens = np.full((B, T), PAD, np.int64)
    tokens[:, 0:2 * P:2], tokens[:, 1:2 * P:2] = keys, values
    asked = _choose(rng, B, P, Q)  # which pairs are queried
    slots = _choose(rng, B, (T - 2 * P) // 2, Q)  # where: query j at 2P + 2 * slot
    pos = 2 * P + 2 * slots
    rows = np.arange(B)[:, None]
    tokens[rows, pos] = np.take_along_axis(keys, asked, 1)
    tokens[rows, pos + 1] = np.take_along_axis(values, asked, 1)
    answer = np.zeros((B, T), bool)
    answer[rows, pos] = True
    return _next_token(tokens, answer)


def selective_copy(seed, *, batch: int, seq_len: int, num_tokens: int, vocab_size: int):
    """Selective copying (Mamba): `num_tokens` data tokens scattered among blanks in a
    region of seq_len - 1 - num_tokens, then a marker, then the data tokens in order."""
    B = _check_int("batch", batch, 1)
    T = _check_int("seq_len", seq_len, 1)
    n = _check_int("num_tokens", num_tokens, 1)
    V = _check_int("vocab_size", vocab_size, 1)
    if V <= COPY_DATA0:
        raise ValueError(f"vocab_size={V} too small: tokens 0-2 are PAD, blank and the copy "
                         f"marker; use vocab_size >= {COPY_DATA0 + 1}")
    R = T - 1 - n
    if R < n:
        raise ValueError(f"seq_len={T} too short for num_tokens={n}: the noisy region "
                         f"(seq_len - 1 - num_tokens) must hold them; use seq_len >= {2 * n + 1}")
    rng = _rng(seed)
    data = rng.integers(COPY_DATA0, V, size=(B, n))
    where = np.sort(_choose(rng, B, R, n), axis=1)
    tokens = np.full((B, T), BLANK, np.int64)
    rows = np.arange(B)[:, None]
    tokens[rows, where] = data
    tokens[:, R] = COPY_MARKER
    tokens[:, R + 1:] = data
    answer = np.zeros((B, T), bool)
    answer[:, R:T - 1] = True
    return _next_token(tokens, answer)


def induction_heads(seed, *, batch: int, seq_len: int, vocab_size: int, prefix_len: int = 1):
    """Induction heads: trigger + r_1..r_m somewhere in random content, repeated at the
    end; the answers are r_1..r_m after the second trigger."""
    B = _check_int("batch", batch, 1)
    T = _check_int("seq_len", seq_len, 1)
    V = _check_int("vocab_size", vocab_size, 1)
    m = _check_int("prefix_len", prefix_len, 1)
    if V <= INDUCTION_CONTENT0:
        raise ValueError(f"vocab_size={V} too small: tokens 0-1 are PAD and the trigger; use "
                         f"vocab_size >= {INDUCTION_CONTENT0 + 1}")
    if T < 2 * (m + 1):
        raise ValueError(f"seq_len={T} too short for prefix_len={m}: the trigger and its "
                         f"{m} tokens occur twice; use seq_len >= {2 * (m + 1)}")
    rng = _rng(seed)
    tokens = rng.integers(INDUCTION_CONTENT0, V, size=(B, T))
    first = rng.integers(0, T - 2 * m - 1, size=(B,))  # first trigger in [0, T - 2m - 2]
    rows = np.arange(B)[:, None]
    span = first[:, None] + np.arange(1, m + 1)
    second = T - m - 1
    tokens[np.arange(B), first] = TRIGGER
    tokens[:, second] = TRIGGER
    tokens[:, second + 1:] = tokens[rows, span]
    answer = np.zeros((B, T), bool)
    answer[:, second:T - 1] = True
    return _next_token(tokens, answer)


def passkey(seed, *, batch: int, seq_len: int, vocab_size: int, num_digits: int = 5,
            depth: float | np.ndarray | None = None):
    """Passkey retrieval: a `num_digits` number hidden at relative `depth` in filler
    (a float in [0, 1], an array of B of them, or None for uniform random per row)."""
    B = _check_int("batch", batch, 1)
    T = _check_int("seq_len", seq_len, 1)
    V = _check_int("vocab_size", vocab_size, 1)
    n = _check_int("num_digits", num_digits, 1)
    if V <= FILLER0:
        raise ValueError(f"vocab_size={V} too small: tokens 0-12 are PAD, the two markers and "
                         f"the ten digits, filler needs at least one more; use vocab_size >= "
                         f"{FILLER0 + 1}")
    C = T - (n + 1)  # context before the query
    if C < n + 1:
        raise ValueError(f"seq_len={T} too short for num_digits={n}: the needle and the query "
                         f"take {n + 1} tokens each; use seq_len >= {2 * (n + 1)}")
    rng = _rng(seed)
    if depth is None:
        d = rng.random(B)
    else:
        d = np.broadcast_to(np.asarray(depth, np.float64), (B,)) if np.ndim(depth) == 0 \
            else np.asarray(depth, np.float64)
        if d.shape != (B,):
            raise ValueError(f"depth must be a float or an array of batch={B} floats, got "
                             f"shape {d.shape}")
        if not np.all((d >= 0) & (d <= 1)):
            raise ValueError(f"depth must lie in [0, 1] (0 = start, 1 = end of the context), "
                             f"got {np.asarray(depth)!r}")
    start = np.rint(d * (C - (n + 1))).astype(np.int64)  # needle start in [0, C - n - 1]
    digits = rng.integers(0, 10, size=(B, n))
    tokens = rng.integers(FILLER0, V, size=(B, T))
    rows = np.arange(B)[:, None]
    tokens[np.arange(B), start] = NEEDLE_MARKER
    tokens[rows, start[:, None] + 1 + np.arange(n)] = DIGIT0 + digits
    tokens[:, C] = QUERY_MARKER
    tokens[:, C + 1:] = DIGIT0 + digits
    answer = np.zeros((B, T), bool)
    answer[:, C:T - 1] = True
    return _next_token(tokens, answer)


def delayed_copy(seed, *, batch: int, seq_len: int, distance: int, vocab_size: int):
    """Output the token `distance` positions back: target[t] = tokens[t - distance] for
    t >= distance (a receptive-field probe; not a next-token task)."""
    B = _check_int("batch", batch, 1)
    T = _check_int("seq_len", seq_len, 1)
    d = _check_int("distance", distance, 1)
    V = _check_int("vocab_size", vocab_size, 1)
    if V < 3:
        raise ValueError(f"vocab_size={V} too small: token 0 is PAD and a copy needs at least "
                         "two content tokens; use vocab_size >= 3")
    if T <= d:
        raise ValueError(f"seq_len={T} must exceed distance={d} so some position has an "
                         f"answer; use seq_len >= {d + 1}")
    rng = _rng(seed)
    tokens = rng.integers(1, V, size=(B, T))
    targets = np.full((B, T), PAD, np.int64)
    targets[:, d:] = tokens[:, :-d]
    mask = np.zeros((B, T), bool)
    mask[:, d:] = True
    return tokens.astype(np.int32), targets.astype(np.int32), mask


TASKS: dict[str, Callable] = {
    "mqar": mqar,
    "selective_copy": selective_copy,
    "induction_heads": induction_heads,
    "passkey": passkey,
    "delayed_copy": delayed_copy,
}


def masked_accuracy(logits, targets, loss_mask) -> float:
    """Share of answer positions (loss_mask) where argmax(logits) == targets."""
    pred = np.asarray(logits).argmax(-1)
    m = np.asarray(loss_mask, bool)
    return float((pred[m] == np.asarray(targets)[m]).mean()) if m.any() else float("nan")
