"""Inference caches: what each layer keeps between decode steps.

Without a cache, generating token t recomputes attention over all t tokens of every
layer, O(t^2) per sequence; with one, a step projects only the new token and
attends over the stored keys and values, O(t) (Pope et al. 2022, "Efficiently
Scaling Transformer Inference"). Design:

- **Only the K kv heads are stored** (`[B, S, K, H]`, after QK-norm and RoPE), so
  GQA with G = N/K query heads per kv head stores 1/G of MHA's bytes and MQA 1/N.
  Arrays are preallocated to the maximum length (fixed shapes: one compilation of
  the decode step) and annotated with logical axes (`batch`, `kv_heads`, and
  `layers` when stacked) so the same rules table that shards the model shards them.
- **Slots.** Position p is stored in slot `p % size`. A global layer has
  `size = max_len`, so slot = position. A sliding-window ("local") layer of window
  W keeps a **rolling buffer of W + 1 slots** (the query and the W keys before it),
  so its memory is bounded by W whatever the length. After `length` tokens, slot s
  holds position `p - ((p - s) mod size)` with `p = length - 1` (negative: empty);
  the decode mask and the ALiBi / T5 biases are computed from these positions.
- **Rows are independent.** Prompts are right-padded: row b has `lengths[b]` real
  tokens at positions 0..lengths[b]-1, and its own `length` counter, so a batch of
  prompts of different lengths generates exactly what each would alone.
- **Prefill vs decode.** A call with T > 1 new tokens is a prefill into an empty
  cache: attention runs over the fresh keys with the model's own masks (the fast
  tiled path), then each cache keeps, per row, the last `size` real positions (a
  gather, so right padding never overwrites real entries of a rolling buffer). A
  call with T = 1 is a decode step: write one slot per row, attend over the cache.
- **Chunked prefill** (`step(..., extend=True)`, `generate(prefill_chunk=C)`): T
  new tokens appended to a non-empty cache, row b taking `lengths[b]` of them (0:
  the row's prompt already ended). Queries attend over the cache's slots followed
  by the T fresh keys under a `ChunkMask` (causal, window, padding: by position),
  then the real new keys are written. Prefill memory is then bounded by C, and a
  rolling buffer needs no more than its W + 1 slots (the fresh keys ride beside it).
- **Recurrent layers** (Mamba, linear attention) keep an O(1) state instead of
  keys: `MambaCache` (the last d_conv - 1 conv inputs and the SSM state `[B, Di,
  N]`), `LinearCache` (the sums S `[B, K, H', Hv]` and z `[B, K, H']`). A prefill
  or chunk runs the mixer's parallel form from the state with per-row `lengths`:
  padding steps get dt = 0 (Mamba: exp(0 A) = 1 and no input) or zero key
  features (linear), and the conv window is gathered at each row's last real
  token, so a padded tail never enters the state; a decode step is the mixer's
  `step`. Their size does not depend on the length.
- **Cross-attention** (encoder-decoder) keeps the encoder output's K/V, computed
  once at the first step (when `context` is passed) and reused after.
- **Scanned layers**: caches of the layers of a scanned cycle are stacked on the
  same leading axis as their parameters and scanned alongside them (`LayerStack`),
  so decode compile time stays flat in depth.

Layer kinds bring their own state. `CACHE_KINDS` maps a layer kind of
`model.layer_pattern` to a `CacheKind`: `init(cfg, batch, max_len, dtype)` makes
the state of the layer's mixer (the module in the block's `attn` slot), and
`slots(cfg, max_len)` gives `(size, window)` for attention-like kinds (None for
recurrent state, which needs no decode mask). A state is a pytree subclass of
`LayerCache` with a `length` `[B]` field (tokens of each row seen after the current
call, set by the model before the layers run),
`apply(module, x, context, *, mask, bias, positions, kv_positions) -> (y, new_state)`,
which the mixer calls when given `cache=` (see `MultiHeadAttention.__call__`), and
`AXES` (field -> logical axis names, for sharding). `positions[:, 0]` is each row's
length before the call, so `length - positions[:, 0]` is its number of real new
tokens. "global" and "local" (KVCache), "mamba" (MambaCache) and "linear"
(LinearCache) are registered below.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.config import ModelConfig
from tfjax.ops import masks as masks_lib
from tfjax.parallel.sharding import shard
from tfjax.registry import Registry

__all__ = [
    "CACHE_KINDS",
    "CacheKind",
    "CrossKVCache",
    "ChunkMask",
    "KVCache",
    "LayerCache",
    "LinearCache",
    "MambaCache",
    "ModelCache",
    "SlotMask",
    "StepInputs",
    "begin_step",
    "cache_bytes",
    "init_cache",
    "kv_bytes_per_token",
    "logical_axes",
    "slot_positions",
]

KV_AXES = ("batch", None, "kv_heads", "head_dim")  # [B, S, K, H]; S replicated


def _pytree(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


class LayerCache:
    """Base of every per-layer inference state (a pytree with a `length` `[B]` field)."""

    length: jax.Array
    AXES: dict = {}  # field -> logical axis names (without the stacked "layers" axis)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def apply(self, module, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        raise NotImplementedError


def slot_positions(length: jax.Array, size: int) -> jax.Array:
    """`[B, size]`: the position each slot holds once `length` `[B]` tokens were
    written at slot `position % size` (-1: empty)."""
    p = length.astype(jnp.int32)[:, None] - 1
    s = jnp.arange(size, dtype=jnp.int32)[None, :]
    pos = p - jnp.mod(p - s, size)
    return jnp.where(pos >= 0, pos, -1)


@_pytree
class KVCache(LayerCache):
    """Self-attention K/V `[B, size, K, H]`; `window` > 0 for a rolling buffer."""

    k: jax.Array
    v: jax.Array
    length: jax.Array  # [B] tokens written (after the current call)
    window: int = _static(default=0)
    AXES = {"k": KV_AXES, "v": KV_AXES}

    @property
    def size(self) -> int:
        return self.k.shape[-3]

    def apply(self, attn, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        if context is not None:
            raise ValueError("a self-attention KV cache got a context (cross-attention)")
        q, k, v = attn.project(x, positions=positions)
        if isinstance(mask, ChunkMask):  # a chunk: [cache slots; fresh keys], then write
            keys = jnp.concatenate([self.k, k.astype(self.k.dtype)], axis=1)
            vals = jnp.concatenate([self.v, v.astype(self.v.dtype)], axis=1)
            return attn.attend(q, keys, vals, mask, bias), self._write(k, v, positions[:, 0])
        if x.shape[1] == 1:  # decode: one slot per row, then attend over the cache
            new = self._append(k, v)
            return attn.attend(q, new.k, new.v, mask, bias), new
        out = attn.attend(q, k, v, mask, bias)  # prefill: the fresh keys, model masks
        return out, self._write(k, v, jnp.zeros_like(self.length))

    def _append(self, k, v):
        B = k.shape[0]
        slot = jnp.mod(self.length.astype(jnp.int32) - 1, self.size)  # [B]
        rows = jnp.arange(B)
        nk = self.k.at[rows, slot].set(k[:, 0].astype(self.k.dtype))
        nv = self.v.at[rows, slot].set(v[:, 0].astype(self.v.dtype))
        return self.replace(k=shard(nk, KV_AXES), v=shard(nv, KV_AXES))

    def _write(self, k, v, start):
        """k/v `[B, T, K, H]` hold positions start[b].. of row b: store, per row, those
        among the last `size` of its `length[b]` positions (the gather keeps right
        padding out of a rolling buffer); other slots keep what they hold."""
        T = k.shape[1]
        pos = slot_positions(self.length, self.size)  # [B, size]
        rel = pos - start.astype(jnp.int32)[:, None]  # index among the new keys
        src = jnp.clip(rel, 0, T - 1)[:, :, None, None]
        new = ((pos >= 0) & (rel >= 0))[:, :, None, None]

        def take(x, old):
            got = jnp.take_along_axis(x, src, axis=1).astype(old.dtype)
            return shard(jnp.where(new, got, old), KV_AXES)

        return self.replace(k=take(k, self.k), v=take(v, self.v))


@_pytree
class CrossKVCache(LayerCache):
    """Cross-attention K/V of the encoder output `[B, S_enc, K, H]`: computed when
    `context` is passed (the first step), reused when it is not."""

    k: jax.Array
    v: jax.Array
    length: jax.Array
    AXES = {"k": KV_AXES, "v": KV_AXES}

    def apply(self, attn, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        if context is not None:
            q, k, v = attn.project(x, context, positions=positions, kv_positions=kv_positions)
            new = self.replace(k=shard(k.astype(self.k.dtype), KV_AXES),
                               v=shard(v.astype(self.v.dtype), KV_AXES))
        else:
            q, new = attn.project_query(x, positions=positions), self
        return attn.attend(q, new.k, new.v, mask, bias), new


def _new_tokens(cache: LayerCache, positions, T: int) -> jax.Array:
    """`[B]` real new tokens of each row in this call (its length before the call is
    `positions[:, 0]`, the position of its first new token)."""
    if positions is None:
        raise ValueError("a recurrent layer cache needs the step's positions (the model's "
                         "`step` passes them)")
    return jnp.clip(cache.length - positions[:, 0].astype(jnp.int32), 0, T)


def _keep_rows(n, new, old):
    """Rows with no new token (n == 0: a finished prompt in a chunk) keep `old`."""
    return jax.tree.map(lambda a, b: jnp.where((n > 0).reshape((-1,) + (1,) * (a.ndim - 1)),
                                               a, b.astype(a.dtype)), new, old)


def _run_recurrent(cache, mixer, x, positions, state):
    """A decode step (`mixer.step`) or a prefill / chunk (`mixer.forward` from `state`,
    padding kept out by per-row lengths) -> (y, new state)."""
    T = x.shape[1]
    n = _new_tokens(cache, positions, T)
    if T == 1:
        y, new = mixer.step(x[:, 0], state)
        return y[:, None], _keep_rows(n, new, state)
    return mixer.forward(x, state, positions=positions, lengths=n)


MAMBA_AXES = {"conv": ("batch", None, "mlp"), "ssm": ("batch", "mlp", None)}
LINEAR_AXES = {"S": ("batch", "kv_heads", None, None), "z": ("batch", "kv_heads", None)}


@_pytree
class MambaCache(LayerCache):
    """A Mamba layer's state: conv `[B, d_conv - 1, Di]` (the last conv inputs) and
    ssm `[B, Di, N]` (float32). O(1) in the length."""

    conv: jax.Array
    ssm: jax.Array
    length: jax.Array
    AXES = MAMBA_AXES

    def apply(self, mixer, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        from tfjax.nn.ssm import MambaState

        if context is not None:
            raise ValueError("a Mamba layer cache got a context (Mamba is a self mixer)")
        y, new = _run_recurrent(self, mixer, x, positions, MambaState(self.conv, self.ssm))
        return (shard(y, ("batch", "length", "embed")),
                self.replace(conv=shard(new.conv.astype(self.conv.dtype), MAMBA_AXES["conv"]),
                             ssm=shard(new.ssm.astype(self.ssm.dtype), MAMBA_AXES["ssm"])))


@_pytree
class LinearCache(LayerCache):
    """A causal linear-attention layer's running sums: S `[B, K, H', Hv]` = sum
    phi(k) v^T and z `[B, K, H']` = sum phi(k) (float32). O(1) in the length."""

    S: jax.Array
    z: jax.Array
    length: jax.Array
    AXES = LINEAR_AXES

    def apply(self, mixer, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        from tfjax.nn.linear_attention import LinearAttentionState

        if context is not None:
            raise ValueError("a linear-attention layer cache got a context (self mixer)")
        if not mixer.causal:
            raise ValueError("generation needs causal linear attention (LinearAttention("
                             "causal=True)); a non-causal layer has no running state")
        y, new = _run_recurrent(self, mixer, x, positions, LinearAttentionState(self.S, self.z))
        return (shard(y, ("batch", "length", "embed")),
                self.replace(S=shard(new.S, LINEAR_AXES["S"]), z=shard(new.z, LINEAR_AXES["z"])))


@_pytree
class ModelCache:
    """The whole model's inference state.

    layers: the layer stack's caches, `{"cycles": (per pattern position, stacked
      [cycles, ...]), "blocks": (per unrolled block)}`, each a dict of sublayer
      caches ("attn", and "cross" in an encoder-decoder's decoder).
    length: `[B]` tokens of each row in the cache (the next token's position).
    encoder_length: `[B]` real encoder tokens (encoder-decoder), else None.
    """

    layers: Any
    length: jax.Array
    encoder_length: Any = None
    max_len: int = _static(default=0)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


# --------------------------------------------------------------------------- #
# Layer kinds.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class CacheKind:
    """How a layer kind keeps state. `init(cfg, batch, max_len, dtype) -> LayerCache`;
    `slots(cfg, max_len) -> (size, window)` for attention (None: no decode mask)."""

    init: Callable[..., LayerCache]
    slots: Callable[[ModelConfig, int], tuple[int, int]] | None = None


CACHE_KINDS: Registry[CacheKind] = Registry("layer cache kind")


def _kv_init(window_of):
    def init(cfg: ModelConfig, batch: int, max_len: int, dtype) -> KVCache:
        size, window = _kv_slots(window_of)(cfg, max_len)
        shape = (batch, size, cfg.kv_heads, cfg.head_size)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                       jnp.zeros((batch,), jnp.int32), window)
    return init


def _kv_slots(window_of):
    def slots(cfg: ModelConfig, max_len: int) -> tuple[int, int]:
        w = window_of(cfg)
        return (min(w + 1, max_len), w) if w else (max_len, 0)
    return slots


CACHE_KINDS.register("global", CacheKind(_kv_init(lambda c: 0), _kv_slots(lambda c: 0)))
CACHE_KINDS.register("local", CacheKind(_kv_init(lambda c: c.sliding_window),
                                        _kv_slots(lambda c: c.sliding_window)))


def _mamba_init(cfg: ModelConfig, batch: int, max_len: int, dtype) -> MambaCache:
    di = cfg.ssm_expand * cfg.d_model  # as tfjax.nn.ssm.Mamba
    return MambaCache(jnp.zeros((batch, cfg.ssm_d_conv - 1, di), dtype),
                      jnp.zeros((batch, di, cfg.ssm_d_state), jnp.float32),
                      jnp.zeros((batch,), jnp.int32))


def _linear_init(cfg: ModelConfig, batch: int, max_len: int, dtype) -> LinearCache:
    from tfjax.nn.linear_attention import FEATURE_MAPS

    phi = FEATURE_MAPS.get(cfg.linear_feature_map, field="model.linear_feature_map")
    hf = jax.eval_shape(phi, jax.ShapeDtypeStruct((cfg.head_size,), jnp.float32)).shape[-1]
    K = cfg.kv_heads
    return LinearCache(jnp.zeros((batch, K, hf, cfg.head_size), jnp.float32),
                       jnp.zeros((batch, K, hf), jnp.float32), jnp.zeros((batch,), jnp.int32))


CACHE_KINDS.register("mamba", CacheKind(_mamba_init))
CACHE_KINDS.register("linear", CacheKind(_linear_init))


# --------------------------------------------------------------------------- #
# Building caches.
# --------------------------------------------------------------------------- #


def _stack_of(model):
    if hasattr(model, "decoder"):  # encoder-decoder: the decoder's stack
        return model.decoder, True
    if hasattr(model, "layers"):
        return model.layers, False
    raise TypeError(f"{type(model).__name__} has no decoder layer stack to cache")


def _kind(kind: str) -> CacheKind:
    if kind not in CACHE_KINDS:
        raise NotImplementedError(
            f"no inference cache for layer kind {kind!r} (model.layer_pattern); register a "
            f"CacheKind for it in tfjax.inference.kv_cache.CACHE_KINDS (cached kinds: "
            f"{', '.join(CACHE_KINDS.names())})")
    return CACHE_KINDS.get(kind)


def _layer_cache(cfg, kind, batch, max_len, dtype, cross, encoder_len):
    c = {"attn": _kind(kind).init(cfg, batch, max_len, dtype)}
    if cross:
        shape = (batch, encoder_len, cfg.kv_heads, cfg.head_size)
        c["cross"] = CrossKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                                  jnp.zeros((batch,), jnp.int32))
    return c


def _layers_cache(cfg: ModelConfig, stack_shape, batch, max_len, dtype, cross, encoder_len):
    pattern, n_cycles, n_blocks = stack_shape
    make = lambda kind: _layer_cache(cfg, kind, batch, max_len, dtype, cross,
                                     encoder_len)
    cycles = None
    if n_cycles:
        cycles = tuple(jax.tree.map(lambda a: jnp.broadcast_to(a, (n_cycles,) + a.shape),
                                    make(kind)) for kind in pattern)
    blocks = tuple(make(pattern[i % len(pattern)]) for i in range(n_blocks))
    return {"cycles": cycles, "blocks": blocks}


def _cycle(cfg: ModelConfig) -> tuple[str, ...]:
    """Layer kinds of one scanned cycle (as `LayerStack.pattern`): the cycle is
    lcm(len(layer_pattern), len(ffn_pattern)) layers when an ffn pattern exists."""
    n = math.lcm(len(cfg.layer_pattern), len(getattr(cfg, "ffn_pattern", None) or ("dense",)))
    return tuple(cfg.layer_kind(i) for i in range(n))


def _stack_shape(cfg: ModelConfig, stack=None):
    """(kinds of one cycle, number of scanned cycles, number of unrolled blocks)."""
    if stack is not None:
        pattern = tuple(stack.pattern)
        n_blocks = len(stack.blocks)
        # a decoder stack has cfg.num_layers layers: whole cycles, then the blocks
        n_cycles = 0 if stack.cycles is None else (cfg.num_layers - n_blocks) // len(pattern)
        return pattern, n_cycles, n_blocks
    pattern = _cycle(cfg)
    n_cycles, rest = divmod(cfg.num_layers, len(pattern))
    if not (cfg.scan_layers and n_cycles):
        return pattern, 0, cfg.num_layers
    return pattern, n_cycles, rest


def init_cache(model, batch: int, max_len: int, *, dtype=None, encoder_length=None,
               encoder_len: int = 0) -> ModelCache:
    """An empty cache for `model` (a DecoderLM or EncoderDecoderModel): `batch` rows of
    up to `max_len` tokens (prompt + generated). Encoder-decoder: `encoder_len` is the
    encoder output's length S and `encoder_length` `[B]` its real tokens per row."""
    cfg: ModelConfig = model.config
    stack, cross = _stack_of(model)
    dtype = jnp.dtype(dtype or cfg.dtype)
    if cross and not encoder_len:
        raise ValueError("init_cache: an encoder-decoder needs encoder_len (the encoder "
                         "output's length) for its cross-attention cache")
    layers = _layers_cache(cfg, _stack_shape(cfg, stack), batch, max_len, dtype, cross,
                           encoder_len)
    if cross:
        encoder_length = (jnp.full((batch,), encoder_len, jnp.int32) if encoder_length is None
                          else jnp.asarray(encoder_length, jnp.int32))
    return ModelCache(layers, jnp.zeros((batch,), jnp.int32),
                      encoder_length if cross else None, max_len)


def cache_bytes(cfg: ModelConfig, batch: int, length: int, *, dtype=None,
                encoder_len: int = 0) -> int:
    """Bytes of the K/V (and other float state) of a cache of `batch` rows of `length`
    tokens (abstract: nothing is allocated; counters excluded). Local layers count
    their W+1 slots, cross-attention (encoder_len > 0) its encoder K/V."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    cross = cfg.arch == "encoder_decoder"
    tree = jax.eval_shape(lambda: _layers_cache(cfg, _stack_shape(cfg), batch, length, dtype,
                                                cross, max(encoder_len, 1)))
    total = 0
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    if cross and not encoder_len:  # counted with S=1 above; take it out
        total -= cfg.num_layers * 2 * batch * cfg.kv_heads * cfg.head_size * dtype.itemsize
    return total


def kv_bytes_per_token(cfg: ModelConfig, *, dtype=None) -> int:
    """2 (K and V) x layers x kv heads x head dim x bytes: one token's cache if every
    layer were global (the textbook formula; local layers cost less past W)."""
    itemsize = jnp.dtype(dtype or cfg.dtype).itemsize
    return 2 * cfg.num_layers * cfg.kv_heads * cfg.head_size * itemsize


def logical_axes(cache: ModelCache):
    """A tree like `cache` of logical axis names per array (for `logical_to_spec`):
    each layer cache's `AXES` (K/V `(layers?, batch, None, kv_heads, head_dim)`, ...),
    counters `(layers?, batch)`; a leading stacked axis is "layers"."""
    def names(x, base):
        extra = x.ndim - len(base)
        return ("layers",) * extra + tuple(base) if extra >= 0 else tuple(base[: x.ndim])

    def layer(c):
        if not isinstance(c, LayerCache):
            return names(c, ("batch",))
        return c.replace(**{f.name: names(getattr(c, f.name), c.AXES.get(f.name, ("batch",)))
                            for f in dataclasses.fields(c) if not f.metadata.get("static")})

    return jax.tree.map(layer, cache, is_leaf=lambda c: isinstance(c, LayerCache))


# --------------------------------------------------------------------------- #
# Decode masks and per-step inputs (used by the models' `step`).
# --------------------------------------------------------------------------- #


@_pytree
class SlotMask(masks_lib.Positions):
    """Decode mask over cache slots: query at `q_positions[b, t]` sees slot s iff it
    holds a position p (`kv_positions[b, s]` >= 0) with p <= query and, for a window
    W > 0, query - p <= W (`masks.Positions`: tiles of empty or out-of-window slots
    are skipped by the tiled implementations, and the pallas kernels take it)."""


@_pytree
class ChunkMask(SlotMask):
    """A chunk's mask (chunked prefill): `kv_positions` `[B, size + T]` are the cache's
    slots then the T fresh keys (-1: empty slot or padding). Its type tells the
    attention cache to attend over `[cache; fresh keys]` and then write them."""


@dataclasses.dataclass
class StepInputs:
    positions: jax.Array  # [B, T]
    masks: dict  # kind -> mask
    biases: dict  # kind -> bias (decode), empty at prefill
    bias: Any  # the shared bias (prefill)
    layers: Any  # layer caches with `length` set
    length: jax.Array  # [B] after this step
    last: jax.Array  # [B] index of each row's last real token among the T new ones
    cache: ModelCache

    def finish(self, layers) -> ModelCache:
        return self.cache.replace(layers=layers, length=self.length)


def _set_length(layers, length):
    def put(c):
        if isinstance(c, LayerCache):
            return c.replace(length=jnp.broadcast_to(length, c.length.shape))
        return c
    return jax.tree.map(put, layers, is_leaf=lambda c: isinstance(c, LayerCache))


def begin_step(cfg: ModelConfig, cache: ModelCache, tokens, lengths, *, rel_bias,
               base_mask, extend: bool = False) -> StepInputs:
    """Positions, masks, biases and updated counters for appending `tokens` `[B,T]`.

    T > 1: a prefill into an empty cache, `lengths` `[B]` real tokens per row
    (right-padded; default T), at positions 0..T-1, under the model's `base_mask`.
    T == 1: a decode step at position `cache.length` over the cache's slots.
    `extend=True`: a chunk of a chunked prefill (any T): row b appends `lengths[b]`
    (may be 0) real tokens at positions `cache.length[b]`.., causally (`ChunkMask`).
    """
    from tfjax.models.stack import (  # models import this module
        layer_masks,
        position_bias,
    )

    B, T = tokens.shape
    if extend:
        lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
                   else jnp.asarray(lengths, jnp.int32))
        old = cache.length.astype(jnp.int32)
        positions = old[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
        fresh = jnp.where(jnp.arange(T)[None, :] < lengths[:, None], positions, -1)
        length = old + lengths
        masks, biases = {}, {}
        for kind in dict.fromkeys(cfg.layer_pattern):
            slots = _kind(kind).slots
            if slots is None:
                masks[kind] = None
                continue
            size, window = slots(cfg, cache.max_len)
            kv_pos = jnp.concatenate([slot_positions(old, size), fresh], axis=1)
            masks[kind] = ChunkMask(positions, kv_pos, window)
            biases[kind] = position_bias(cfg, rel_bias, positions, kv_pos)
        return StepInputs(positions, masks, biases, None, _set_length(cache.layers, length),
                          length, jnp.maximum(lengths - 1, 0), cache)
    if T > 1:
        lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
                   else jnp.asarray(lengths, jnp.int32))
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        length = cache.length + lengths
        masks = layer_masks(cfg, base_mask)
        bias = position_bias(cfg, rel_bias, positions, positions)
        return StepInputs(positions, masks, {}, bias, _set_length(cache.layers, length), length,
                          lengths - 1, cache)
    positions = cache.length[:, None].astype(jnp.int32)  # [B, 1]
    length = cache.length + 1
    masks, biases = {}, {}
    for kind in dict.fromkeys(cfg.layer_pattern):
        slots = _kind(kind).slots
        if slots is None:
            masks[kind] = None
            continue
        size, window = slots(cfg, cache.max_len)
        kv_pos = slot_positions(length, size)
        masks[kind] = SlotMask(positions, kv_pos, window)
        biases[kind] = position_bias(cfg, rel_bias, positions, kv_pos)
    return StepInputs(positions, masks, biases, None, _set_length(cache.layers, length), length,
                      jnp.zeros((B,), jnp.int32), cache)


def last_token(x: jax.Array, last: jax.Array) -> jax.Array:
    """x `[B, T, D]` -> `[B, 1, D]` at index `last[b]` of each row."""
    return jnp.take_along_axis(x, last.astype(jnp.int32)[:, None, None], axis=1)
