"""Autoregressive generation with KV caches: a jitted prefill, then a jitted decode loop.

    out = tfjax.inference.generate(model, prompt_tokens, max_new_tokens=64,
                                   prompt_lengths=None, temperature=0.0, top_k=None,
                                   top_p=None, eos_id=None, seed=0)      # [B, 64] int32

Prompts are right-padded (`prompt_lengths`); each row generates what it would alone,
stops at `eos_id` and then emits `pad_id`. One compiled program per model structure
and shapes; `prefill_chunk=C` prefills C tokens at a time. `stream(...)` yields each
step's `[B]` tokens, the same as `generate`'s. See docs/inference.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.inference.sampling import sample
from tfjax.parallel.sharding import active_mesh

__all__ = ["generate", "stream"]


def _is_encoder_decoder(model) -> bool:
    return getattr(model.config, "arch", "decoder") == "encoder_decoder"


def longrope_switch(model, prompt_len: int, cache_len: int) -> int | None:
    """The position whose decode step must rebuild the cache with LongRoPE's long
    factors (`rope.original_max_len`), or None when generation never crosses it (no
    longrope, the prompt already past it, or the sequence never reaching it)."""
    rope = getattr(model.config, "rope", None)
    if _is_encoder_decoder(model) or rope is None or rope.scaling != "longrope":
        return None
    switch = int(rope.original_max_len)
    return switch if prompt_len <= switch < cache_len - 1 else None


@functools.lru_cache(maxsize=16)
def _programs(graphdef, mesh=None):
    """Jitted (start, step, run) for one model structure (compiled per shape). The
    active mesh (`tfjax.parallel.sharding.use_rules`) is part of the key: `shard`
    constraints are read when tracing."""

    def merge(state):
        model = nnx.merge(graphdef, state)
        model.eval()
        return model

    def prefill(state, prompt, lengths, cache, C, inputs=None):
        """Decoder-only prefill, in chunks of C tokens when 0 < C < T; `inputs`: the
        model's other prefill inputs by keyword (`pixel_values`), whole prompts only."""
        T = prompt.shape[1]
        if not C or C >= T:
            return merge(state).step(prompt, cache, lengths, **(inputs or {}))
        n = -(-T // C)
        prompt = jnp.pad(prompt, ((0, 0), (0, n * C - T)))

        def chunk(i):
            return (jax.lax.dynamic_slice_in_dim(prompt, i * C, C, axis=1),
                    jnp.clip(lengths - i * C, 0, C))

        # The first chunk is a plain prefill into the empty cache (every row has >= 1
        # real token); the others extend it. Parameters ride in the carry (see loop).
        toks, lens = chunk(0)
        logits, cache = merge(state).step(toks, cache, lens)

        def body(i, c):
            cache, logits, state = c
            toks, lens = chunk(i)
            new, cache = merge(state).step(toks, cache, lens, extend=True)
            logits = jnp.where((lens > 0)[:, None, None], new, logits)  # row's last real token
            return cache, logits, state

        cache, logits, _ = jax.lax.fori_loop(1, n, body, (cache, logits, state))
        return logits, cache

    def start(state, prompt, lengths, key, settings, *, cache_len, decoder_start_id,
              prefill_chunk=0, inputs=None):
        model = merge(state)
        B, T = prompt.shape
        if _is_encoder_decoder(model):
            seg = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.int32)
            encoded = model.encode(prompt, encoder_segment_ids=seg)
            cache = model.init_cache(B, cache_len, encoder_length=lengths, encoder_len=T)
            first = jnp.full((B, 1), decoder_start_id, jnp.int32)
            logits, cache = model.step(first, cache, encoded)
        else:
            cache = model.init_cache(B, cache_len)
            logits, cache = prefill(state, prompt, lengths, cache, prefill_chunk, inputs)
        return sample(jax.random.fold_in(key, 0), logits[:, 0], **settings), cache

    def step(state, cache, tok, key, i, settings):
        logits, cache = merge(state).step(tok[:, None], cache)
        return sample(jax.random.fold_in(key, i), logits[:, 0], **settings), cache

    def reencode(state, seq, n_real, key, i, settings):
        """The decode step of LongRoPE's switch: one prefill of `seq` `[B, cache_len]`
        (row b: `n_real[b]` tokens so far, the last one the token being decoded) into
        an empty cache; positions reach cache_len - 1, so every key is rotated with
        the long factors."""
        B, cache_len = seq.shape
        cache = merge(state).init_cache(B, cache_len)
        logits, cache = prefill(state, seq, n_real, cache, 0)
        return sample(jax.random.fold_in(key, i), logits[:, 0], **settings), cache

    def loop(state, cache, tok, key, settings, eos_id, pad_id, prompt, lengths, *, n,
             cache_len, switch):
        B = tok.shape[0]
        # LongRoPE: every row's tokens so far, for the one re-encoding step.
        seq = (None if switch is None else
               jnp.pad(prompt, ((0, 0), (0, cache_len - prompt.shape[1]))))
        switch_at = None if switch is None else switch - jnp.max(lengths)  # loop index

        # The parameters ride in the carry: nnx transforms inside the body (the
        # scanned layers) need their variables at the body's trace level.
        def cond(c):
            i, _, _, _, done, _, _ = c
            return (i < n) & ~jnp.all(done)

        def body(c):
            i, tok, cache, out, done, state, seq = c
            out = out.at[:, i].set(jnp.where(done, pad_id, tok))
            done = done | (tok == eos_id)
            if switch is None:
                tok, cache = step(state, cache, tok, key, i + 1, settings)
            else:  # tok sits at position lengths + i
                seq = seq.at[jnp.arange(B), lengths + i].set(tok)
                # The parameters are operands of the branches too (nnx trace levels).
                tok, cache = jax.lax.cond(
                    i == switch_at,
                    lambda state, cache, tok: reencode(state, seq, lengths + i + 1, key, i + 1,
                                                       settings),
                    lambda state, cache, tok: step(state, cache, tok, key, i + 1, settings),
                    state, cache, tok)
            return i + 1, tok, cache, out, done, state, seq

        init = (jnp.int32(0), tok, cache, jnp.full((B, n), pad_id, jnp.int32),
                jnp.zeros((B,), bool), state, seq)
        return jax.lax.while_loop(cond, body, init)[3]

    def run(state, prompt, lengths, key, settings, eos_id, pad_id, *, cache_len, n,
            decoder_start_id, prefill_chunk=0, switch=None, inputs=None):
        tok, cache = start(state, prompt, lengths, key, settings, cache_len=cache_len,
                           decoder_start_id=decoder_start_id, prefill_chunk=prefill_chunk,
                           inputs=inputs)
        return loop(state, cache, tok, key, settings, eos_id, pad_id, prompt, lengths, n=n,
                    cache_len=cache_len, switch=switch)

    return (jax.jit(start, static_argnames=("cache_len", "decoder_start_id", "prefill_chunk")),
            jax.jit(step, donate_argnums=1),
            jax.jit(run, static_argnames=("cache_len", "n", "decoder_start_id",
                                          "prefill_chunk", "switch")),
            jax.jit(reencode))


def _check_chunk(model, prefill_chunk, T) -> int:
    if prefill_chunk is None:
        return 0
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive int (tokens per prefill chunk) or "
                         f"None, got {prefill_chunk!r}")
    if _is_encoder_decoder(model):
        raise ValueError("prefill_chunk: an encoder-decoder encodes its prompt at once; chunked "
                         "prefill is for decoder-only models (pass prefill_chunk=None)")
    rope = getattr(model.config, "rope", None)
    longrope = rope is not None and rope.scaling == "longrope"
    if longrope and prefill_chunk < T > rope.original_max_len:
        raise ValueError(f"prefill_chunk={prefill_chunk}: a LongRoPE prompt of {T} tokens, past "
                         f"model.rope.original_max_len={rope.original_max_len}, is rotated with "
                         f"the long factors throughout; chunks would rotate the first ones with "
                         f"the short factors (pass prefill_chunk=None)")
    if getattr(model.config, "prefix_lm", False) and T > prefill_chunk:
        raise ValueError(f"prefill_chunk={prefill_chunk} < prompt length {T}: a prefix-LM "
                         f"prompt is one bidirectional prefix and cannot be split; pass "
                         f"prefill_chunk=None")
    return prefill_chunk


def _prepare(model, prompt_tokens, max_new_tokens, prompt_lengths, temperature, top_k, top_p,
             eos_id, pad_id, seed):
    prompt = jnp.asarray(prompt_tokens, jnp.int32)
    if prompt.ndim != 2:
        raise ValueError(f"prompt_tokens must be [B, T] integers, got shape {prompt.shape}")
    B, T = prompt.shape
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    else:
        lengths = jnp.asarray(prompt_lengths, jnp.int32)
        if lengths.shape != (B,):
            raise ValueError(f"prompt_lengths must be [B] = [{B}], got shape {lengths.shape}")
        try:
            lo, hi = int(jnp.min(lengths)), int(jnp.max(lengths))
        except jax.errors.ConcretizationTypeError:  # traced: checked by the caller
            lo, hi = 1, T
        if lo < 1 or hi > T:
            raise ValueError(f"prompt_lengths must be in [1, T={T}] (right-padded prompts), "
                             f"got min {lo}, max {hi}")
    cfg = model.config
    enc_dec = _is_encoder_decoder(model)
    cache_len = max_new_tokens + 1 if enc_dec else T + max_new_tokens
    if cfg.position == "learned" and cache_len > cfg.max_len:
        raise ValueError(f"max_new_tokens: prompt + generated = {cache_len} tokens exceed "
                         f"model.max_len={cfg.max_len} (learned position table)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 1 (or None), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    settings = dict(temperature=jnp.float32(temperature),
                    top_k=jnp.int32(top_k or 0), top_p=jnp.float32(1.0 if top_p is None else top_p))
    eos = -1 if eos_id is None else int(eos_id)
    pad = pad_id if pad_id is not None else (0 if eos_id is None else eos_id)
    graphdef, state = nnx.split(model)
    return (graphdef, state, prompt, lengths, settings, cache_len, jnp.int32(eos),
            jnp.int32(pad), jax.random.key(seed))


def generate(model, prompt_tokens, *, max_new_tokens: int, prompt_lengths=None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int | None = None, seed: int = 0, pad_id: int | None = None,
             decoder_start_id: int = 0, prefill_chunk: int | None = None,
             pixel_values=None) -> jax.Array:
    """`max_new_tokens` tokens `[B, max_new_tokens]` int32 after each (right-padded)
    prompt; rows that emitted `eos_id` continue with `pad_id`. `prefill_chunk=C`
    prefills the prompt C tokens at a time (same result, prefill memory bounded by C).
    `pixel_values`: the images of a decoder with an image prefix
    (`tfjax.models.ImagePrefixLM`), encoded once by its prefill, checked first."""
    inputs = None
    if pixel_values is not None:
        inputs = {"pixel_values": jnp.asarray(pixel_values)}
        model.check_inputs(prompt_tokens, inputs["pixel_values"])
    graphdef, state, prompt, lengths, settings, cache_len, eos, pad, key = _prepare(
        model, prompt_tokens, max_new_tokens, prompt_lengths, temperature, top_k, top_p, eos_id,
        pad_id, seed)
    chunk = _check_chunk(model, prefill_chunk, prompt.shape[1])
    run = _programs(graphdef, active_mesh())[2]  # prefill and decode loop: one program, one dispatch
    return run(state, prompt, lengths, key, settings, eos, pad, cache_len=cache_len,
               n=int(max_new_tokens), decoder_start_id=int(decoder_start_id),
               prefill_chunk=chunk,
               switch=longrope_switch(model, prompt.shape[1], cache_len), inputs=inputs)


def stream(model, prompt_tokens, *, max_new_tokens: int, prompt_lengths=None,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           eos_id: int | None = None, seed: int = 0, pad_id: int | None = None,
           decoder_start_id: int = 0, prefill_chunk: int | None = None
           ) -> Iterator[np.ndarray]:
    """Yield the `[B]` tokens of each step as soon as they exist (same tokens as
    `generate`); stops after max_new_tokens or once every row emitted EOS."""
    graphdef, state, prompt, lengths, settings, cache_len, eos, pad, key = _prepare(
        model, prompt_tokens, max_new_tokens, prompt_lengths, temperature, top_k, top_p, eos_id,
        pad_id, seed)
    chunk = _check_chunk(model, prefill_chunk, prompt.shape[1])
    start, step, _, reencode = _programs(graphdef, active_mesh())
    tok, cache = start(state, prompt, lengths, key, settings, cache_len=cache_len,
                       decoder_start_id=int(decoder_start_id), prefill_chunk=chunk)
    switch = longrope_switch(model, prompt.shape[1], cache_len)
    if switch is not None:  # every row's tokens so far, for LongRoPE's re-encoding step
        n_real = np.asarray(lengths)
        seq = np.zeros((prompt.shape[0], cache_len), np.int32)
        seq[:, :prompt.shape[1]] = np.asarray(prompt)
    done = np.zeros(prompt.shape[0], bool)
    for i in range(max_new_tokens):
        t = np.asarray(tok)
        yield np.where(done, int(pad), t).astype(np.int32)
        done |= t == int(eos)
        if done.all() or i + 1 == max_new_tokens:
            return
        if switch is not None:
            seq[np.arange(len(t)), n_real + i] = t
            if int(n_real.max()) + i == switch:
                tok, cache = reencode(state, jnp.asarray(seq), jnp.asarray(n_real + i + 1), key,
                                      jnp.int32(i + 1), settings)
                continue
        tok, cache = step(state, cache, tok, key, jnp.int32(i + 1), settings)
