"""Choosing the next token from logits: one setting for the batch, or one per row.

    next = sample(key, logits, temperature=0.8, top_k=40, top_p=0.95)   # [B] int32
    out = sample_rows(logits, SamplingParams.of(requests, rows=B), positions,
                      prompt_seen, output_counts, num_logprobs=5)      # Sampled

Order as Hugging Face / vLLM: penalties (`sample_rows`), temperature, top-k, top-p
(Holtzman et al. 2020), min-p, draw; temperature 0 is greedy. Every setting is traced
(`top_k=0`, `top_p=1` off), so one program serves any mix; ties with the last kept
logit stay. Row b draws with `fold_in(key(seed[b]), positions[b])`: a request's
tokens do not depend on its batch. See docs/inference.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CANDIDATES", "SamplingParams", "Sampled", "check_settings", "filter_logits",
           "processed_logits", "row_keys", "sample", "sample_rows", "sampling_probs",
           "token_counts"]


# A row's top-k of at most this many is filtered on `lax.top_k`'s candidates (XLA:CPU
# sorts a [16, 2048] batch of logits in ~5 ms, takes its top 64 in ~0.1 ms).
CANDIDATES = 64


def filter_logits(logits: jax.Array, top_k=None, top_p=None, *,
                  candidates: int | None = None) -> jax.Array:
    """logits `[..., V]` with -inf outside the top-k / top-p support. `candidates` C
    (static): rank only the C largest logits (`lax.top_k`), exact when top_k is in
    1..C (top-p then picks among the top k); None ranks all V (a sort)."""
    logits = logits.astype(jnp.float32)
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    if candidates is None or candidates >= V:
        ranked = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # [..., V] descending
    else:
        ranked = jax.lax.top_k(logits, candidates)[0]  # [..., C] descending
    idx = jnp.arange(ranked.shape[-1])
    if top_k is not None:
        k = jnp.asarray(top_k, jnp.int32)
        k = jnp.where(k <= 0, V, jnp.minimum(k, V))
        kth = jnp.take_along_axis(ranked, jnp.broadcast_to(k - 1, ranked.shape[:-1])[..., None],
                                  axis=-1)
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
        ranked = jnp.where(idx < k, ranked, -jnp.inf)
    if top_p is not None:
        p = jnp.asarray(top_p, jnp.float32)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        keep = (before < p) | (idx == 0) | (p >= 1.0)
        n = jnp.sum(keep, axis=-1, keepdims=True)  # a prefix of the ranking
        threshold = jnp.take_along_axis(ranked, n - 1, axis=-1)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return logits


def sample(key: jax.Array, logits: jax.Array, temperature=0.0, top_k=None,
           top_p=None) -> jax.Array:
    """Next tokens `[B]` int32 from logits `[B, V]` (temperature 0: greedy). A step where
    no row samples draws nothing, and the logits are ranked (a sort of `[B, V]`) only
    where some row samples with top-k or top-p on (traced 0 / 1: off)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.asarray(temperature, jnp.float32)
    on = jnp.zeros((), bool)
    if top_k is not None:
        on |= jnp.any(jnp.asarray(top_k) > 0)
    if top_p is not None:
        on |= jnp.any(jnp.asarray(top_p) < 1)

    def draw(logits):
        scaled = logits / jnp.where(t > 0, t, 1.0)
        scaled = jax.lax.cond(on, lambda x: filter_logits(x, top_k, top_p), lambda x: x, scaled)
        return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(t > 0), draw, lambda _: greedy, logits)
    return jnp.where(t > 0, drawn, greedy)


def sampling_probs(logits: jax.Array, temperature, top_k=None, top_p=None) -> jax.Array:
    """The distribution `[..., V]` that `sample` draws from at temperature > 0: softmax of
    the logits divided by the temperature, outside top-k / top-p zero (speculative
    sampling's p and q)."""
    t = jnp.asarray(temperature, jnp.float32)
    scaled = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    return jax.nn.softmax(filter_logits(scaled, top_k, top_p), axis=-1)


# --------------------------------------------------------------------------- #
# Per-request settings: one row of the batch per request.
# --------------------------------------------------------------------------- #

def _number(name: str, value, where: str, *, integer: bool = False):
    number = isinstance(value, (int, float, np.integer, np.floating)) and \
        not isinstance(value, bool)
    whole = number and (isinstance(value, (int, np.integer)) or float(value).is_integer())
    if not number or (integer and not whole):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}{where}")
    return int(value) if integer else float(value)


def _in(name, value, where, ok: bool, allowed: str):
    if not ok:  # NaN fails every comparison, so it lands here too
        raise ValueError(f"{name} must be {allowed}, got {value!r}{where}")


def check_settings(settings: Mapping, where: str = "") -> dict:
    """One request's sampling settings (a dict; None or missing: the default) validated
    and completed: a one-line ValueError names the setting and its allowed range (the
    server answers HTTP 400 with it). `where` is appended to the message."""
    unknown = sorted(set(settings) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown sampling setting {unknown[0]!r}{where}; known: "
                         f"{', '.join(_DEFAULTS)}")
    s = {**_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    t = _number("temperature", s["temperature"], where)
    _in("temperature", t, where, 0.0 <= t < math.inf, "a finite number >= 0 (0 = greedy)")
    k = _number("top_k", s["top_k"], where, integer=True)
    _in("top_k", k, where, k >= 0, "an integer >= 0 (0 = off)")
    p = _number("top_p", s["top_p"], where)
    _in("top_p", p, where, 0.0 < p <= 1.0, "in (0, 1] (1 = off)")
    m = _number("min_p", s["min_p"], where)
    _in("min_p", m, where, 0.0 <= m <= 1.0, "in [0, 1] (0 = off)")
    r = _number("repetition_penalty", s["repetition_penalty"], where)
    _in("repetition_penalty", r, where, 0.0 < r < math.inf, "a finite number > 0 (1 = off)")
    out = dict(temperature=t, top_k=min(k, 2**31 - 1), top_p=p, min_p=m,  # past V: off
               repetition_penalty=r)
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(name, s[name], where)
        _in(name, v, where, -2.0 <= v <= 2.0, "in [-2, 2] (0 = off; OpenAI's range)")
        out[name] = v
    seed = secrets.randbits(32) if s["seed"] is None else s["seed"]
    seed = _number("seed", seed, where, integer=True)
    _in("seed", seed, where, -2**31 <= seed < 2**32, "an integer in [-2**31, 2**32)")
    out["seed"] = seed % 2**32  # an int32's bits: -1 and 2**32 - 1 are one seed
    return out


# A request's defaults, as OpenAI's API and vLLM have them (seed None: a fresh one).
_DEFAULTS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                 presence_penalty=0.0, frequency_penalty=0.0, seed=None)
# A padding row: greedy, every filter and penalty off, seed 0.
_PADDING = dict(_DEFAULTS, temperature=0.0, seed=0)
_DTYPES = dict(temperature=np.float32, top_k=np.int32, top_p=np.float32, min_p=np.float32,
               repetition_penalty=np.float32, presence_penalty=np.float32,
               frequency_penalty=np.float32, seed=np.uint32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Each row's sampling settings, arrays `[B]` (a pytree: every field is traced).

    temperature f32 (0 = greedy), top_k i32 (0 = off), top_p f32 (1 = off), min_p f32
    (0 = off), repetition_penalty f32 (1 = off; prompt and output tokens, HF / CTRL),
    presence_penalty and frequency_penalty f32 (0 = off; output tokens, OpenAI), seed
    uint32. Build it with `SamplingParams.of`.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    seed: jax.Array

    @classmethod
    def of(cls, requests: Sequence[Mapping | None], rows: int | None = None) -> SamplingParams:
        """Row b from `requests[b]`, a dict of settings (missing ones take OpenAI's
        defaults: temperature 1, filters and penalties off, a fresh random seed); a
        None request and the rows past `len(requests)` up to `rows` are padding
        (greedy, seed 0). A bad value raises a one-line ValueError naming the setting,
        the allowed range and the request's index (a server's HTTP 400)."""
        rows = len(requests) if rows is None else rows
        if rows < len(requests):
            raise ValueError(f"rows={rows} is fewer than the {len(requests)} requests")
        filled = []
        for b in range(rows):
            request = requests[b] if b < len(requests) else None
            if request is None:
                filled.append(_PADDING)
            elif not isinstance(request, Mapping):
                raise ValueError(f"request {b}: sampling settings must be a dict, got "
                                 f"{type(request).__name__}")
            else:
                filled.append(check_settings(request, f" (request {b})"))
        return cls(**{name: np.array([f[name] for f in filled], dtype)
                      for name, dtype in _DTYPES.items()})

    @classmethod
    def padding(cls, rows: int) -> SamplingParams:
        """`rows` padding rows (greedy, seed 0)."""
        return cls.of([], rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    """What `sample_rows` returns: `tokens` `[B]` int32, `logprobs` `[B]` f32 (of the
    chosen tokens under the raw distribution), and with `num_logprobs=n` the raw
    distribution's n most likely tokens, `top_ids` `[B, n]` int32 and `top_logprobs`
    `[B, n]` f32 (else None)."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def token_counts(tokens: jax.Array, vocab_size: int, lengths: jax.Array | None = None
                 ) -> jax.Array:
    """`[B, V]` int32: how often each token occurs in the first `lengths[b]` (default:
    all T) tokens of row b of `tokens` `[B, T]` (a prompt's `> 0` is `prompt_seen`)."""
    B, T = tokens.shape
    real = (jnp.ones((B, T), bool) if lengths is None
            else jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None])
    counts = jnp.zeros((B, vocab_size), jnp.int32)
    return counts.at[jnp.arange(B)[:, None], tokens].add(real.astype(jnp.int32))


def row_keys(seed: jax.Array, positions: jax.Array) -> jax.Array:
    """Row b's key `fold_in(key(seed[b]), positions[b])`: `[B]` typed keys."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, positions)


def _penalise(logits, params: SamplingParams, prompt_seen, output_counts):
    """Repetition (HF / CTRL: over prompt and output tokens, a positive logit divided,
    a negative one multiplied), then presence and frequency (OpenAI: output tokens)."""
    col = lambda x: jnp.asarray(x, jnp.float32)[:, None]  # noqa: E731 - [B] -> [B, 1]
    seen = prompt_seen | (output_counts > 0)
    r = col(params.repetition_penalty)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    counts = output_counts.astype(jnp.float32)
    return (logits - col(params.presence_penalty) * (counts > 0)
            - col(params.frequency_penalty) * counts)


def processed_logits(logits: jax.Array, params: SamplingParams, prompt_seen: jax.Array,
                     output_counts: jax.Array) -> jax.Array:
    """The logits `[B, V]` that `sample_rows` draws from at temperature > 0: penalised,
    divided by the temperature, -inf outside each row's top-k, top-p and min-p
    (prob >= min_p x the largest prob) support."""
    logits = _penalise(logits.astype(jnp.float32), params, prompt_seen, output_counts)
    t = jnp.asarray(params.temperature, jnp.float32)[:, None]
    scaled = logits / jnp.where(t > 0, t, 1.0)
    top_k = jnp.asarray(params.top_k, jnp.int32)
    top_p = jnp.asarray(params.top_p, jnp.float32)
    # a row with a top-k of 1..CANDIDATES ranks only that many logits, one with top-p
    # alone (or a larger top-k) all of them (a sort), one with no filter none: each row
    # by its own settings, so its tokens do not depend on the batch
    few = (top_k >= 1) & (top_k <= CANDIDATES)
    every = ~few & ((top_k > 0) | (top_p < 1.0))

    def filtered_by(rows, candidates):
        run = jax.vmap(functools.partial(filter_logits, candidates=candidates))
        return jax.lax.cond(jnp.any(rows), lambda x: run(x, top_k, top_p), lambda x: x, scaled)

    filtered = jnp.where(few[:, None], filtered_by(few, CANDIDATES),
                         jnp.where(every[:, None], filtered_by(every, None), scaled))
    probs = jax.nn.softmax(filtered, axis=-1)
    floor = jnp.asarray(params.min_p, jnp.float32)[:, None] * jnp.max(probs, -1, keepdims=True)
    return jnp.where(probs >= floor, filtered, -jnp.inf)


def sample_rows(logits: jax.Array, params: SamplingParams, positions: jax.Array,
                prompt_seen: jax.Array, output_counts: jax.Array, *,
                num_logprobs: int = 0) -> Sampled:
    """One token per row of logits `[B, V]`, each row with its own settings `params`.

    positions `[B]`: the position of the token drawn (with the row's seed, its key);
    prompt_seen `[B, V]` bool: tokens of the row's prompt; output_counts `[B, V]`
    int32: how often each token was generated so far (`token_counts`). Greedy rows
    (temperature 0) take the argmax of the penalised logits. `logprobs` are the
    log-probabilities under the model's RAW distribution (log_softmax of the
    unprocessed logits), as vLLM reports them by default and OpenAI defines them;
    `num_logprobs` (static) > 0 adds that many top tokens of it.
    """
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(_penalise(logits, params, prompt_seen, output_counts), axis=-1)
    greedy = greedy.astype(jnp.int32)

    def draw(logits):
        final = processed_logits(logits, params, prompt_seen, output_counts)
        keys = row_keys(jnp.asarray(params.seed), jnp.asarray(positions, jnp.int32))
        return jax.vmap(jax.random.categorical)(keys, final).astype(jnp.int32)

    sampled = jnp.asarray(params.temperature) > 0
    drawn = jax.lax.cond(jnp.any(sampled), draw, lambda _: greedy, logits)  # all greedy: none
    tokens = jnp.where(sampled, drawn, greedy)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    if not num_logprobs:
        return Sampled(tokens, chosen)
    top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
    return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
