"""Speculative decoding: a drafter proposes D tokens, the decoder verifies them in one
cache chunk of D + 1 tokens, every cache rolls back to the committed ones.

    tokens, stats = speculative_generate(model, prompt, max_new_tokens=64,
                                         drafter="mtp" | "ngram", temperature=0.8)

Drafters (`tfjax.inference.drafters`): the model's MTP modules or prompt lookup.
Temperature 0 gives exactly greedy `generate`'s tokens; above it the exact rule of
Leviathan et al. / Chen et al. 2023 (accept with min(1, p/q), resample from
max(0, p - q)) draws from plain sampling's distribution. Every layer must keep a
global K/V or latent cache (others are refused by name). See docs/inference.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.inference.cache import check_rewindable, rewind
from tfjax.inference.drafters import MtpDrafter, NgramDrafter, put_rows, take_rows
from tfjax.inference.generate import longrope_switch
from tfjax.inference.sampling import sampling_probs

__all__ = ["accept_drafts", "speculative_generate"]

# What a key drawn at a position is for: a draft there, its acceptance test, or the
# committed token drawn from the residual (or the bonus, or the first token).
_DRAFT, _ACCEPT, _COMMIT = 0, 1, 2
_USES = 3


def accept_drafts(p, drafts, q, u):
    """The exact acceptance rule for one verification, per row.

    p `[B, D + 1, V]`: the target distribution after the last committed token and
    after each draft; drafts `[B, D]` with their draft distribution q `[B, D, V]`
    (None: a point mass on each draft); u `[B, D]` uniforms in [0, 1). Draft j is
    accepted when u_j q_j(d_j) < p_j(d_j), i.e. with probability min(1, p/q).
    Returns (a `[B]`: the leading accepted drafts, `[B, V]`: the distribution of the
    token after them, normalize(max(0, p_a - q_a)), or p_D when all D were accepted).
    """
    D = drafts.shape[1]
    p_d = jnp.take_along_axis(p[:, :D], drafts[..., None], axis=-1)[..., 0]
    q_full = jax.nn.one_hot(drafts, p.shape[-1], dtype=p.dtype) if q is None else q
    q_d = jnp.take_along_axis(q_full, drafts[..., None], axis=-1)[..., 0]
    ok = (u * q_d < p_d).astype(jnp.int32)
    a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
    q_full = jnp.concatenate([q_full, jnp.zeros_like(q_full[:, :1])], axis=1)  # q_D = 0
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - jnp.take_along_axis(q_full, a[:, None, None], axis=1)[:, 0], 0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    return a, jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_a)


def _greedy_choice(logits, p, k):
    return jnp.argmax(logits, axis=-1), None


class _Sampler:
    """Speculative sampling's draws: the processed distributions (temperature, top-k,
    top-p: `sampling_probs`) and row b's key for (position x, use u): `fold_in(
    fold_in(key(seed), b), 3x + u)`, so every position's draws are fresh."""

    def __init__(self, settings, batch: int):
        self.settings = settings
        self.rows = jax.vmap(lambda b: jax.random.fold_in(settings["key"], b))(
            jnp.arange(batch))

    def keys(self, positions, use: int):
        """Row b's keys `positions.shape` for (positions[b, ...], use)."""
        fold = jax.vmap(jax.random.fold_in)
        for _ in range(positions.ndim - 1):
            fold = jax.vmap(fold, in_axes=(None, -1), out_axes=-1)
        return fold(self.rows, positions * _USES + use)

    def probs(self, logits):
        s = self.settings
        return sampling_probs(logits, s["temperature"], s["top_k"], s["top_p"])

    def draw(self, probs, positions, use: int):
        """One token per row from probs `[B, V]` with its key at positions `[B]`."""
        keys = self.keys(positions, use)
        return jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)

    def uniforms(self, positions):
        """`[B, D]` uniforms in [0, 1) with the keys at positions `[B, D]`."""
        return jax.vmap(jax.vmap(jax.random.uniform))(self.keys(positions, _ACCEPT))

    def choose(self, logits, p, k):
        """The draft at position p + k drawn from its processed distribution q, and q."""
        q = self.probs(logits)
        return self.draw(q, p + k, _DRAFT), q


@functools.lru_cache(maxsize=8)
def _program(graphdef, max_new: int, prompt_len: int, drafter):
    def merge(state):
        model = nnx.merge(graphdef, state)
        model.eval()
        return model

    def run(state, prompt, lengths, eos_id, settings=None):
        model = merge(state)
        D = drafter.num_draft
        B = prompt.shape[0]
        sampler = None if settings is None else _Sampler(settings, B)
        choose = _greedy_choice if sampler is None else sampler.choose
        size = prompt_len + max_new + 2 * D + 2  # the furthest a row writes
        cache = model.init_cache(B, size)
        check_rewindable(cache, "a decoder layer")
        draft_caches = drafter.init_caches(model, B, size)
        seq = jnp.zeros((B, size + D + 1), jnp.int32).at[:, :prompt_len].set(prompt)
        hbuf = None  # the decoder's last hidden states, for a drafter that reads them
        if drafter.reads_hidden:
            logits, cache, hidden = model.step(prompt, cache, lengths, return_hidden=True)
            hbuf = jnp.zeros((B, size, hidden.shape[-1]), hidden.dtype)
            hbuf = hbuf.at[:, :prompt_len].set(hidden)
        else:
            logits, cache = model.step(prompt, cache, lengths)
        if sampler is not None:
            first = sampler.draw(sampler.probs(logits[:, -1]), lengths, _COMMIT)
        else:
            first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        seq = put_rows(seq, lengths[:, None], first[:, None], jnp.ones((B, 1), bool))
        done = jnp.zeros((B,), bool) if eos_id is None else first == eos_id
        stats = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

        def active_rows(p, done):
            return (~done) & (p - lengths < max_new - 1)  # p - lengths + 1 tokens made

        # The parameters ride in the carry: nnx transforms inside the body (the
        # scanned layers) need their variables at the body's trace level.
        def cond(carry):
            _, _, _, _, p, done, _, _, _ = carry
            return jnp.any(active_rows(p, done))

        def body(carry):
            cache, draft_caches, seq, hbuf, p, done, (calls, proposed, accepted), q, state = carry
            model = merge(state)
            active = verified = active_rows(p, done)
            # verify: the decoder over [t_p, d_1..d_D]
            steps = jnp.arange(D + 1)[None, :]
            vpos = p[:, None] + steps
            chunk = take_rows(seq, vpos)
            out = model.step(chunk, cache, jnp.where(active, D + 1, 0), all_logits=True,
                             extend=True, return_hidden=drafter.reads_hidden)
            logits, cache = out[0], out[1]
            if sampler is None:
                greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # g_j after token p + j
                match = (chunk[:, 1:] == greedy[:, :-1]).astype(jnp.int32)  # d_j == g_{j-1}
                a = jnp.where(active, jnp.sum(jnp.cumprod(match, axis=1), axis=1), 0)
            else:
                u = sampler.uniforms(vpos[:, 1:])
                a, after = accept_drafts(sampler.probs(logits), chunk[:, 1:], q, u)
                a = jnp.where(active, a, 0)
            at = (p + a + 1)[:, None]  # the token after the accepted drafts
            nxt = (jnp.take_along_axis(greedy, a[:, None], 1) if sampler is None
                   else sampler.draw(after, at[:, 0], _COMMIT)[:, None])
            seq = put_rows(seq, at, nxt, active[:, None])
            if drafter.reads_hidden:
                hbuf = put_rows(hbuf, vpos, out[2], active[:, None] & (steps <= a[:, None]))
            if eos_id is not None:  # EOS among the committed tokens p+1 .. p+a+1
                hit = (take_rows(seq, vpos + 1) == eos_id) & (steps <= a[:, None])
                done = done | (active & jnp.any(hit, axis=1))
            # roll back to the committed tokens, then draft the next D
            new_p = jnp.where(active, p + a + 1, p)
            cache = rewind(cache, new_p)
            draft_caches = drafter.rewind(draft_caches, p, new_p, active)
            active = active_rows(new_p, done)
            draft_caches, seq, q = drafter.draft(model, draft_caches, seq, hbuf, new_p, active,
                                                 D + 1, choose)
            stats = (calls + 1, proposed + D * jnp.sum(verified), accepted + jnp.sum(a))
            return cache, draft_caches, seq, hbuf, new_p, done, stats, q, state

        p0 = lengths.astype(jnp.int32)
        draft_caches, seq, q = drafter.draft(model, draft_caches, seq, hbuf, p0,
                                             active_rows(p0, done), prompt_len, choose)
        carry = (cache, draft_caches, seq, hbuf, p0, done, stats, q, state)
        _, _, seq, _, p, _, (calls, proposed, accepted), _, _ = jax.lax.while_loop(
            cond, body, carry)
        out = take_rows(seq, lengths[:, None] + jnp.arange(max_new)[None, :])
        if eos_id is not None:  # after a row's EOS: pad (= eos), as generate does
            after = jnp.cumsum((out == eos_id).astype(jnp.int32), axis=1) - (out == eos_id)
            out = jnp.where(after > 0, eos_id, out)
        return out, dict(decoder_calls=calls, proposed=proposed, accepted=accepted)

    return jax.jit(run, static_argnames=("eos_id",))


def _drafter(model, drafter: str, num_draft, max_ngram):
    cfg = model.config
    if drafter == "mtp":
        if not getattr(cfg, "mtp_depth", 0):
            raise ValueError("speculative_generate(drafter='mtp') needs a model with multi-token "
                             "prediction modules (model.mtp_depth >= 1); drafter='ngram' needs "
                             "none")
        if max_ngram is not None:
            raise ValueError("max_ngram is the n-gram drafter's; pass drafter='ngram' or drop it")
        D = cfg.mtp_depth if num_draft is None else num_draft
        if isinstance(D, bool) or not isinstance(D, int) or not 1 <= D <= cfg.mtp_depth:
            raise ValueError(f"num_draft must be in [1, model.mtp_depth={cfg.mtp_depth}] (one "
                             f"draft per MTP module), got {num_draft!r}")
        return MtpDrafter(D)
    if drafter == "ngram":
        D = 4 if num_draft is None else num_draft
        n = 3 if max_ngram is None else max_ngram
        for name, v in (("num_draft", D), ("max_ngram", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        return NgramDrafter(D, n)
    raise ValueError(f"drafter must be 'mtp' (the model's multi-token prediction modules) or "
                     f"'ngram' (prompt lookup), got {drafter!r}")


def speculative_generate(model, prompt, *, max_new_tokens: int, prompt_lengths=None,
                         eos_id: int | None = None, drafter: str = "mtp",
                         num_draft: int | None = None, max_ngram: int | None = None,
                         temperature: float = 0.0, top_k: int | None = None,
                         top_p: float | None = None, seed: int = 0):
    """`max_new_tokens` tokens per row (`[B, max_new_tokens]` int32, EOS then `eos_id` as
    padding, like `generate`), `num_draft` drafted per decoder call by `drafter`:
    "mtp" (the model's MTP modules; default and most: `model.mtp_depth`) or "ngram"
    (prompt lookup over n-grams of up to `max_ngram` tokens, default 3; default 4
    drafts). Temperature 0 is greedy; above it, with `top_k` / `top_p` as `generate`
    has them, exact speculative sampling with keys from `seed`. Returns (tokens,
    stats): `decoder_calls` (loop iterations after the prefill), `proposed` and
    `accepted` draft tokens and `acceptance` (accepted / proposed)."""
    draft = _drafter(model, drafter, num_draft, max_ngram)
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or max_new_tokens < 1:
        raise ValueError(f"prompt must be [B, T] and max_new_tokens >= 1, got "
                         f"{prompt.shape} and {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: off), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p}")
    B, T = prompt.shape
    lengths = (jnp.full((B,), T, jnp.int32) if prompt_lengths is None
               else jnp.asarray(prompt_lengths, jnp.int32))
    if longrope_switch(model, T, T + max_new_tokens) is not None:
        raise ValueError(f"speculative decoding: prompt {T} + max_new_tokens {max_new_tokens} "
                         f"crosses model.rope.original_max_len={model.config.rope.original_max_len}"
                         f", where LongRoPE re-encodes the sequence; use generate() or stay "
                         f"within it")
    graphdef, state = nnx.split(model)
    settings = None if temperature == 0 else dict(
        temperature=jnp.float32(temperature), top_k=jnp.int32(top_k or 0),
        top_p=jnp.float32(1.0 if top_p is None else top_p), key=jax.random.key(seed))
    run = _program(graphdef, int(max_new_tokens), T, draft)
    out, stats = run(state, prompt, lengths, eos_id=eos_id, settings=settings)
    stats = {k: int(v) for k, v in stats.items()}
    stats["acceptance"] = stats["accepted"] / max(stats["proposed"], 1)
    return out, stats
