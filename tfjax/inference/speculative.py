"""Self-speculative greedy decoding with a model's own multi-token prediction modules
(`model.mtp_depth` = D, `tfjax.models.mtp`) as the draft.

    tokens, stats = speculative_generate(model, prompt, max_new_tokens=64,
                                         prompt_lengths=None, eos_id=None)
    stats["acceptance"]  # accepted draft tokens / proposed ones

Each iteration the modules draft D tokens, the decoder verifies them in one cache chunk
of D + 1 tokens and every cache rolls back to the committed ones: exactly greedy
`generate`'s tokens. Every layer must keep a global K/V or latent cache (others are
refused by name). See docs/inference.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.inference.cache import check_rewindable, rewind
from tfjax.inference.generate import longrope_switch

__all__ = ["speculative_generate"]


def _gather(x, idx):
    """x `[B, L, ...]`, idx `[B, T]` -> `[B, T, ...]` (indices clipped to the buffer)."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def _scatter(x, idx, values, where):
    """Row b: x[b, idx[b, j]] = values[b, j] where `where[b, j]`."""
    rows = jnp.arange(x.shape[0])[:, None]
    idx = jnp.where(where, idx, x.shape[1])  # out of range: dropped
    return x.at[rows, idx].set(values.astype(x.dtype), mode="drop")


@functools.lru_cache(maxsize=8)
def _program(graphdef, max_new: int, prompt_len: int):
    def merge(state):
        model = nnx.merge(graphdef, state)
        model.eval()
        return model

    def run(state, prompt, lengths, eos_id):
        model = merge(state)
        D = model.config.mtp_depth
        B = prompt.shape[0]
        size = prompt_len + max_new + 2 * D + 2  # the furthest a row writes
        cache = model.init_cache(B, size)
        mtp_caches = tuple(m.init_cache(B, size) for m in model.mtp)
        check_rewindable(cache, "a decoder layer")
        for c in mtp_caches:
            check_rewindable(c, "an MTP module's layer")
        seq = jnp.zeros((B, size + D + 1), jnp.int32).at[:, :prompt_len].set(prompt)
        logits, cache, hidden = model.step(prompt, cache, lengths, return_hidden=True)
        hbuf = jnp.zeros((B, size, hidden.shape[-1]), hidden.dtype).at[:, :prompt_len].set(hidden)
        first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        seq = _scatter(seq, lengths[:, None], first[:, None], jnp.ones((B, 1), bool))
        done = jnp.zeros((B,), bool) if eos_id is None else first == eos_id
        stats = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

        def active_rows(p, done):
            return (~done) & (p - lengths < max_new - 1)  # p - lengths + 1 tokens made

        def draft(model, mtp_caches, seq, hbuf, p, active, T):
            """Module k over its missing positions [f, p) (a chunk of T >= p - f),
            drafting token p + k from position p - 1."""
            f = mtp_caches[0].length
            pos = f[:, None] + jnp.arange(T)[None, :]
            n = jnp.where(active, p - f, 0)
            last = jnp.maximum(n - 1, 0)[:, None, None]
            h, new = model.head_input(_gather(hbuf, pos)), []  # h^0: after the final norm
            for k, (module, c) in enumerate(zip(model.mtp, mtp_caches), start=1):
                e = model.embed(_gather(seq, pos + k), pos + k)
                h, c = module.step(h, e, c, n, rel_bias=model.rel_bias)
                h = module.norm(h)
                new.append(c)
                at_last = jnp.take_along_axis(h, last, axis=1)
                d = jnp.argmax(model.head(at_last)[:, 0], axis=-1)
                seq = _scatter(seq, (p + k)[:, None], d[:, None], active[:, None])
            return tuple(new), seq

        # The parameters ride in the carry: nnx transforms inside the body (the
        # scanned layers) need their variables at the body's trace level.
        def cond(carry):
            _, _, _, _, p, done, _, _ = carry
            return jnp.any(active_rows(p, done))

        def body(carry):
            cache, mtp_caches, seq, hbuf, p, done, (calls, proposed, accepted), state = carry
            model = merge(state)
            active = verified = active_rows(p, done)
            # verify: the decoder over [t_p, d_1..d_D]
            steps = jnp.arange(D + 1)[None, :]
            vpos = p[:, None] + steps
            chunk = _gather(seq, vpos)
            logits, cache, hidden = model.step(chunk, cache, jnp.where(active, D + 1, 0),
                                               all_logits=True, extend=True,
                                               return_hidden=True)
            greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # g_j after token p + j
            match = (chunk[:, 1:] == greedy[:, :-1]).astype(jnp.int32)  # d_j == g_{j-1}
            a = jnp.where(active, jnp.sum(jnp.cumprod(match, axis=1), axis=1), 0)
            seq = _scatter(seq, (p + a + 1)[:, None], jnp.take_along_axis(greedy, a[:, None], 1),
                           active[:, None])
            hbuf = _scatter(hbuf, vpos, hidden, active[:, None] & (steps <= a[:, None]))
            if eos_id is not None:  # EOS among the committed tokens p+1 .. p+a+1
                hit = (_gather(seq, vpos + 1) == eos_id) & (steps <= a[:, None])
                done = done | (active & jnp.any(hit, axis=1))
            # roll back to the committed tokens, then draft the next D
            new_p = jnp.where(active, p + a + 1, p)
            cache = rewind(cache, new_p)
            f = mtp_caches[0].length
            keep = jnp.where(active, jnp.maximum(jnp.minimum(new_p - D, p), 0), f)
            mtp_caches = tuple(rewind(c, keep) for c in mtp_caches)
            active = active_rows(new_p, done)
            mtp_caches, seq = draft(model, mtp_caches, seq, hbuf, new_p, active, D + 1)
            stats = (calls + 1, proposed + D * jnp.sum(verified), accepted + jnp.sum(a))
            return cache, mtp_caches, seq, hbuf, new_p, done, stats, state

        p0 = lengths.astype(jnp.int32)
        mtp_caches, seq = draft(model, mtp_caches, seq, hbuf, p0, active_rows(p0, done),
                                prompt_len)
        carry = (cache, mtp_caches, seq, hbuf, p0, done, stats, state)
        _, _, seq, _, p, _, (calls, proposed, accepted), _ = jax.lax.while_loop(cond, body, carry)
        out = _gather(seq, lengths[:, None] + jnp.arange(max_new)[None, :])
        if eos_id is not None:  # after a row's EOS: pad (= eos), as generate does
            after = jnp.cumsum((out == eos_id).astype(jnp.int32), axis=1) - (out == eos_id)
            out = jnp.where(after > 0, eos_id, out)
        return out, dict(decoder_calls=calls, proposed=proposed, accepted=accepted)

    return jax.jit(run, static_argnames=("eos_id",))


def speculative_generate(model, prompt, *, max_new_tokens: int, prompt_lengths=None,
                         eos_id: int | None = None):
    """Greedy decoding of `max_new_tokens` per row (`[B, max_new_tokens]` int32, EOS then
    `eos_id` as padding, like `generate(temperature=0)`) with the model's MTP modules
    drafting D tokens per decoder call. Returns (tokens, stats): `decoder_calls`
    (loop iterations after the prefill), `proposed` and `accepted` draft tokens and
    `acceptance` (accepted / proposed)."""
    cfg = model.config
    if not getattr(cfg, "mtp_depth", 0):
        raise ValueError("speculative_generate needs a model with multi-token prediction "
                         "modules (model.mtp_depth >= 1)")
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or max_new_tokens < 1:
        raise ValueError(f"prompt must be [B, T] and max_new_tokens >= 1, got "
                         f"{prompt.shape} and {max_new_tokens}")
    B, T = prompt.shape
    lengths = (jnp.full((B,), T, jnp.int32) if prompt_lengths is None
               else jnp.asarray(prompt_lengths, jnp.int32))
    if longrope_switch(model, T, T + max_new_tokens) is not None:
        raise ValueError(f"speculative decoding: prompt {T} + max_new_tokens {max_new_tokens} "
                         f"crosses model.rope.original_max_len={cfg.rope.original_max_len}, where "
                         f"LongRoPE re-encodes the sequence; use generate() or stay within it")
    graphdef, state = nnx.split(model)
    out, stats = _program(graphdef, int(max_new_tokens), T)(state, prompt, lengths,
                                                            eos_id=eos_id)
    stats = {k: int(v) for k, v in stats.items()}
    stats["acceptance"] = stats["accepted"] / max(stats["proposed"], 1)
    return out, stats

