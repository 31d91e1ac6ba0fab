"""Inference caches: what each layer keeps between decode steps, and the facts the
model reads from them (which position each slot holds).

Without a cache, generating token t recomputes attention over all t tokens of every
layer, O(t^2) per sequence; with one, a step projects only the new token and
attends over the stored keys and values, O(t) (Pope et al. 2022, "Efficiently
Scaling Transformer Inference"). Design:

- **Only the K kv heads are stored** (`[B, K, S, H]`, heads-major, after QK-norm and
  RoPE: the layout the Pallas TPU kernels read in place), so
  GQA with G = N/K query heads per kv head stores 1/G of MHA's bytes and MQA 1/N.
  Arrays are preallocated to the maximum length (fixed shapes: one compilation of
  the decode step) and annotated with logical axes (`batch`, `kv_heads`, and
  `layers` when stacked; `logical_axes`) so the same rules table that shards the
  model shards them.
- **Slots.** Position p is stored in slot `p % size`. A global layer has
  `size = max_len`, so slot = position. A sliding-window layer of window W keeps
  a **rolling buffer of W + 1 slots** (the query and the W keys before it), so its
  memory is bounded by W whatever the length. After `length` tokens, slot s holds
  position `p - ((p - s) mod size)` with `p = length - 1` (negative: empty):
  `slot_positions`, from which the model builds its decode masks and ALiBi / T5
  biases (`tfjax.models.attention_inputs`); this module builds no mask.
- **Rows are independent.** Prompts are right-padded: row b has `lengths[b]` real
  tokens at positions 0..lengths[b]-1, and its own `length` counter, so a batch of
  prompts of different lengths generates exactly what each would alone.
- **Prefill, decode, chunk.** A call with T > 1 new tokens into an empty cache is a
  prefill: attention runs over the fresh keys with the model's own masks (the fast
  tiled path), then each cache keeps, per row, the last `size` real positions (a
  gather, so right padding never overwrites real entries of a rolling buffer). A
  call with T = 1 is a decode step: write one slot per row, attend over the cache.
  A chunk of a chunked prefill (`KVCache.chunk`, set by the model's step with
  `extend=True`): T new tokens appended to a non-empty cache, row b taking
  `lengths[b]` of them (0: its prompt already ended); queries attend over the
  cache's slots followed by the T fresh keys (the model's mask is by position),
  then the real new keys are written. Prefill memory is then bounded by the chunk,
  and a rolling buffer needs no more than its W + 1 slots.
- **Recurrent layers** (Mamba, linear attention) keep an O(1) state instead of
  keys: `MambaCache` (the last d_conv - 1 conv inputs and the SSM state `[B, Di,
  N]`), `Mamba2Cache` (the same for Mamba-2: conv inputs `[B, d_conv - 1, Di +
  2GN]`, SSM state `[B, H, P, N]`), `LinearCache` (the sums S `[B, K, H', Hv]` and z `[B, K, H']`),
  `GatedDeltaNetCache` (q/k/v conv windows and the delta-rule state S `[B, Hv, dk,
  dv]`). A prefill or chunk runs the mixer's parallel form from the state with
  per-row `lengths`: padding steps get dt = 0 (Mamba: exp(0 A) = 1 and no input),
  zero key features (linear) or beta = g = 0 (Gated DeltaNet: no write, no decay),
  and the conv window is gathered at each row's last real token, so a padded tail
  never enters the state; a decode step is the mixer's `step`. Their size does not
  depend on the length.
- **Latent attention** (DeepSeek's MLA) keeps `LatentCache`: per token the
  normalised kv latent and the rotated shared key (r + dr values, no per-head K/V),
  decoded in the absorbed form (`tfjax.nn.latent_attention`).
- **Cross-attention** (encoder-decoder) keeps the encoder output's K/V, computed
  once at the first step (when `context` is passed) and reused after.

The state protocol: a layer state is a pytree subclass of `LayerCache` with a
`length` `[B]` field (tokens of each row after the current call, set with
`for_step` before the layers run), `apply(module, x, context, *, mask, bias,
positions, kv_positions) -> (y, new_state)`, which the mixer calls when given
`cache=` (see `MultiHeadAttention.__call__`), and `AXES` (field -> logical axis
names). `positions[:, 0]` is each row's length before the call, so
`length - positions[:, 0]` is its number of real new tokens. Which state each
layer kind keeps, and the whole model's cache (`ModelCache`, one state per layer
of the layer stack's layout), are made on the model side
(`tfjax.models.layer_kinds`, `model.init_cache`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tfjax.nn.gated_deltanet import GatedDeltaNetState
from tfjax.nn.linear_attention import LinearAttentionState
from tfjax.nn.mamba2 import Mamba2State
from tfjax.nn.ssm import MambaState
from tfjax.parallel.sharding import shard

__all__ = [
    "CrossKVCache",
    "GatedDeltaNetCache",
    "KVCache",
    "LatentCache",
    "LayerCache",
    "LinearCache",
    "Mamba2Cache",
    "MambaCache",
    "ModelCache",
    "append_slot",
    "for_step",
    "logical_axes",
    "slot_positions",
    "slot_step",
    "slots_major",
    "write_slots",
]

KV_AXES = ("batch", None, "kv_heads", "head_dim")  # [B, S, K, H]; S replicated
STORED_KV_AXES = ("batch", "kv_heads", None, "head_dim")  # [B, K, S, H]: as stored
LATENT_AXES = ("batch", None, "latent")  # [B, S, r + dr]


def slots_major(x: jax.Array) -> jax.Array:
    """A stored K or V `[B, K, S, H]` as the attention op reads it, `[B, S, K, H]` (and
    back: the swap is its own inverse). A view for XLA: the TPU kernels transpose it
    back to heads-major, which cancels, and XLA's dots take either layout."""
    return jnp.swapaxes(x, 1, 2)


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

    def for_step(self, length: jax.Array, *, chunk: bool) -> "LayerCache":
        """This state for a call that leaves `length` `[B]` tokens in each row;
        `chunk`: the call appends a chunk to a non-empty cache."""
        return self.replace(length=jnp.broadcast_to(length, self.length.shape))

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
    """Self-attention K/V stored heads-major, `[B, K, size, H]` (the layout the TPU
    kernels read, so a decode step does not relay the cache out, even across a jit
    boundary where H = 128; `slots_major` gives the op's `[B, size, K, H]` view;
    experiments/results/attention_layer_tpu_aot_20261204.md); `window` > 0
    for a rolling buffer (then size = min(window + 1, max_len)). `chunk`: the current
    call appends a chunk to a non-empty cache (attend over `[slots; fresh keys]`,
    then write), as the model's step says through `for_step`."""

    k: jax.Array
    v: jax.Array
    length: jax.Array  # [B] tokens written (after the current call)
    window: int = _static(default=0)
    chunk: bool = _static(default=False)
    AXES = {"k": STORED_KV_AXES, "v": STORED_KV_AXES}

    @classmethod
    def empty(cls, batch: int, size: int, kv_heads: int, head_dim: int, dtype, *,
              window: int = 0, v_head_dim: int | None = None) -> "KVCache":
        shape = (batch, kv_heads, size)
        return cls(jnp.zeros((*shape, head_dim), dtype),
                   jnp.zeros((*shape, v_head_dim or head_dim), dtype),
                   jnp.zeros((batch,), jnp.int32), window)

    @property
    def size(self) -> int:
        return self.k.shape[-2]

    def for_step(self, length, *, chunk):
        return super().for_step(length, chunk=chunk).replace(chunk=chunk)

    def apply(self, attn, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None, layer=None, first_values=None, adapter=None):
        """`layer` / `first_values`: a layer stack's, for differential attention and
        the value residual (`MultiHeadAttention`); the mixed values are stored.
        `adapter`: the call's projection deltas (`MultiHeadAttention.project`)."""
        if context is not None:
            raise ValueError("a self-attention KV cache got a context (cross-attention)")
        depth = {} if layer is None and first_values is None else dict(
            layer=layer, first_values=first_values)
        q, k, v = attn.project(x, positions=positions, adapter=adapter, **depth)
        extra = {} if layer is None else dict(layer=layer)
        out, (k, v) = slot_step(
            self, (slots_major(self.k), slots_major(self.v)), (k, v), positions, KV_AXES,
            lambda kv, cached: attn.attend(q, *kv, mask, bias, x=x, **extra))
        return out, self.replace(k=slots_major(k), v=slots_major(v))  # sharded as written


def slot_step(cache, olds, fresh, positions, axes, attend):
    """One call of a cache whose slots hold per-token arrays (`olds`, `[B, size, ...]`,
    sharded as `axes`), with this call's `fresh` arrays `[B, T, ...]`: a chunk
    attends over `[slots; fresh]`, then writes; a decode step (T = 1) writes its
    slot, then attends over the slots; a prefill attends over the fresh arrays (the
    model's own masks), then writes. `attend(arrays, cached)` -> the output; `cached`
    is False for the prefill. -> (output, the new slot arrays)."""
    if cache.chunk:
        out = attend(tuple(jnp.concatenate([o, f.astype(o.dtype)], axis=1)
                           for o, f in zip(olds, fresh)), True)
        news = write_slots(cache.length, positions[:, 0], olds, fresh, axes)
    elif fresh[0].shape[1] == 1:
        news = append_slot(cache.length, olds, fresh, axes)
        out = attend(news, True)
    else:
        out = attend(fresh, False)
        news = write_slots(cache.length, jnp.zeros_like(cache.length), olds, fresh, axes)
    return out, news


def append_slot(length, olds, news, axes):
    """A decode step's write: each of `news` `[B, 1, ...]` into slot `(length - 1) %
    size` of its row of the matching `olds` `[B, size, ...]` (sharded as `axes`)."""
    size = olds[0].shape[1]
    slot = jnp.mod(length.astype(jnp.int32) - 1, size)  # [B]
    rows = jnp.arange(olds[0].shape[0])
    return tuple(shard(o.at[rows, slot].set(n[:, 0].astype(o.dtype)), axes)
                 for o, n in zip(olds, news))


def write_slots(length, start, olds, news, axes):
    """A prefill's or chunk's write: `news` `[B, T, ...]` hold positions start[b]..
    of row b; store, per row, those among the last `size` of its `length[b]`
    positions (the gather keeps right padding out of a rolling buffer); other slots
    of `olds` `[B, size, ...]` keep what they hold."""
    size, T = olds[0].shape[1], news[0].shape[1]
    pos = slot_positions(length, size)  # [B, size]
    rel = pos - start.astype(jnp.int32)[:, None]  # index among the new keys
    out = []
    for o, n in zip(olds, news):
        tail = (1,) * (o.ndim - 2)
        src = jnp.clip(rel, 0, T - 1).reshape(*rel.shape, *tail)
        new = ((pos >= 0) & (rel >= 0)).reshape(*rel.shape, *tail)
        got = jnp.take_along_axis(n, src, axis=1).astype(o.dtype)
        out.append(shard(jnp.where(new, got, o), axes))
    return tuple(out)


@_pytree
class LatentCache(LayerCache):
    """Multi-head Latent Attention's cache (`tfjax.nn.latent_attention`): per token
    only the normalised latent and the rotated shared key, `latent` `[B, size, r +
    dr]`; slots as `KVCache`'s (a global layer: size = max_len). Prefill runs the
    materialised form over the fresh tokens; a decode step or a chunk runs the
    absorbed form over the slots (and the chunk's fresh latents)."""

    latent: jax.Array
    length: jax.Array
    chunk: bool = _static(default=False)
    AXES = {"latent": LATENT_AXES}

    @classmethod
    def empty(cls, batch: int, size: int, width: int, dtype) -> "LatentCache":
        return cls(jnp.zeros((batch, size, width), dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def size(self) -> int:
        return self.latent.shape[1]

    def for_step(self, length, *, chunk):
        return super().for_step(length, chunk=chunk).replace(chunk=chunk)

    def apply(self, attn, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        if context is not None or bias is not None:
            raise ValueError("a latent attention cache takes no context and no bias")
        tables = attn.tables(positions)  # q_pe's and k_pe's
        q_nope, q_pe = attn.queries(x, positions, tables)

        def attend(arrays, cached):  # the absorbed form over cached latents
            form = attn.attend_absorbed if cached else attn.attend
            return form(q_nope, q_pe, arrays[0], mask)

        out, (latent,) = slot_step(self, (self.latent,), (attn.latent(x, positions, tables),),
                                   positions, LATENT_AXES, attend)
        return out, self.replace(latent=latent)


@_pytree
class CrossKVCache(LayerCache):
    """Cross-attention K/V of the encoder output, stored heads-major `[B, K, S_enc, H]`
    as `KVCache`'s: computed when `context` is passed (the first step), reused when it
    is not."""

    k: jax.Array
    v: jax.Array
    length: jax.Array
    AXES = {"k": STORED_KV_AXES, "v": STORED_KV_AXES}

    @classmethod
    def empty(cls, batch: int, length: int, kv_heads: int, head_dim: int, dtype, *,
              v_head_dim: int | None = None) -> "CrossKVCache":
        shape = (batch, kv_heads, length)
        return cls(jnp.zeros((*shape, head_dim), dtype),
                   jnp.zeros((*shape, v_head_dim or head_dim), dtype),
                   jnp.zeros((batch,), jnp.int32))

    def apply(self, attn, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        if context is not None:
            q, k, v = attn.project(x, context, positions=positions, kv_positions=kv_positions)
            new = self.replace(k=shard(slots_major(k.astype(self.k.dtype)), STORED_KV_AXES),
                               v=shard(slots_major(v.astype(self.v.dtype)), STORED_KV_AXES))
        else:
            q, new = attn.project_query(x, positions=positions), self
        return attn.attend(q, slots_major(new.k), slots_major(new.v), mask, bias, x=x), new


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
MAMBA2_AXES = {"conv": ("batch", None, None), "ssm": ("batch", "heads", None, None)}
LINEAR_AXES = {"S": ("batch", "kv_heads", None, None), "z": ("batch", "kv_heads", None)}
GDN_AXES = {"conv_q": ("batch", None, "kv_heads", "head_dim"),
            "conv_k": ("batch", None, "kv_heads", "head_dim"),
            "conv_v": ("batch", None, "heads", "head_dim"), "S": ("batch", "heads", None, None)}


@_pytree
class MambaCache(LayerCache):
    """A Mamba layer's state: conv `[B, d_conv - 1, Di]` (the last conv inputs) and
    ssm `[B, Di, N]` (float32). O(1) in the length."""

    conv: jax.Array
    ssm: jax.Array
    length: jax.Array
    AXES = MAMBA_AXES

    @classmethod
    def empty(cls, batch: int, d_conv: int, d_inner: int, d_state: int, dtype) -> "MambaCache":
        return cls(jnp.zeros((batch, d_conv - 1, d_inner), dtype),
                   jnp.zeros((batch, d_inner, d_state), jnp.float32),
                   jnp.zeros((batch,), jnp.int32))

    def apply(self, mixer, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        if context is not None:
            raise ValueError("a Mamba layer cache got a context (Mamba is a self mixer)")
        y, new = _run_recurrent(self, mixer, x, positions, MambaState(self.conv, self.ssm))
        return (shard(y, ("batch", "length", "embed")),
                self.replace(conv=shard(new.conv.astype(self.conv.dtype), MAMBA_AXES["conv"]),
                             ssm=shard(new.ssm.astype(self.ssm.dtype), MAMBA_AXES["ssm"])))


@_pytree
class Mamba2Cache(LayerCache):
    """A Mamba-2 layer's state (`tfjax.nn.mamba2`): conv `[B, d_conv - 1, Di + 2GN]`
    (the last conv inputs of x, B and C) and ssm `[B, H, P, N]` (float32). O(1) in
    the length."""

    conv: jax.Array
    ssm: jax.Array
    length: jax.Array
    AXES = MAMBA2_AXES

    @classmethod
    def empty(cls, batch: int, d_conv: int, conv_dim: int, num_heads: int, head_dim: int,
              d_state: int, dtype) -> "Mamba2Cache":
        return cls(jnp.zeros((batch, d_conv - 1, conv_dim), dtype),
                   jnp.zeros((batch, num_heads, head_dim, d_state), jnp.float32),
                   jnp.zeros((batch,), jnp.int32))

    def apply(self, mixer, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        if context is not None:
            raise ValueError("a Mamba-2 layer cache got a context (Mamba-2 is a self mixer)")
        y, new = _run_recurrent(self, mixer, x, positions, Mamba2State(self.conv, self.ssm))
        return (shard(y, ("batch", "length", "embed")),
                self.replace(conv=shard(new.conv.astype(self.conv.dtype), MAMBA2_AXES["conv"]),
                             ssm=shard(new.ssm.astype(self.ssm.dtype), MAMBA2_AXES["ssm"])))


@_pytree
class LinearCache(LayerCache):
    """A causal linear-attention layer's running sums: S `[B, K, H', Hv]` = sum
    phi(k) v^T and z `[B, K, H']` = sum phi(k) (float32). O(1) in the length."""

    S: jax.Array
    z: jax.Array
    length: jax.Array
    AXES = LINEAR_AXES

    @classmethod
    def empty(cls, batch: int, kv_heads: int, feature_dim: int, head_dim: int) -> "LinearCache":
        """feature_dim H': the feature map's output width for a head dim H."""
        return cls(jnp.zeros((batch, kv_heads, feature_dim, head_dim), jnp.float32),
                   jnp.zeros((batch, kv_heads, feature_dim), jnp.float32),
                   jnp.zeros((batch,), jnp.int32))

    def apply(self, mixer, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        if context is not None:
            raise ValueError("a linear-attention layer cache got a context (self mixer)")
        if not mixer.causal:
            raise ValueError("generation needs causal linear attention (LinearAttention("
                             "causal=True)); a non-causal layer has no running state")
        y, new = _run_recurrent(self, mixer, x, positions, LinearAttentionState(self.S, self.z))
        return (shard(y, ("batch", "length", "embed")),
                self.replace(S=shard(new.S, LINEAR_AXES["S"]), z=shard(new.z, LINEAR_AXES["z"])))


@_pytree
class GatedDeltaNetCache(LayerCache):
    """A Gated DeltaNet layer's state (`tfjax.nn.gated_deltanet`): the last d_conv - 1
    conv inputs conv_q, conv_k `[B, d_conv - 1, Hk, dk]`, conv_v `[B, d_conv - 1, Hv,
    dv]`, and the delta-rule state S `[B, Hv, dk, dv]` (float32). O(1) in the length."""

    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    S: jax.Array
    length: jax.Array
    AXES = GDN_AXES

    @classmethod
    def empty(cls, batch: int, d_conv: int, num_k_heads: int, num_v_heads: int,
              head_k_dim: int, head_v_dim: int, dtype) -> "GatedDeltaNetCache":
        qk = (batch, d_conv - 1, num_k_heads, head_k_dim)
        return cls(jnp.zeros(qk, dtype), jnp.zeros(qk, dtype),
                   jnp.zeros((batch, d_conv - 1, num_v_heads, head_v_dim), dtype),
                   jnp.zeros((batch, num_v_heads, head_k_dim, head_v_dim), jnp.float32),
                   jnp.zeros((batch,), jnp.int32))

    def apply(self, mixer, x, context=None, *, mask=None, bias=None, positions=None,
              kv_positions=None):
        if context is not None:
            raise ValueError("a Gated DeltaNet layer cache got a context (a self mixer)")
        state = GatedDeltaNetState(self.conv_q, self.conv_k, self.conv_v, self.S)
        y, new = _run_recurrent(self, mixer, x, positions, state)
        new = {f: shard(getattr(new, f).astype(getattr(self, f).dtype), axes)
               for f, axes in GDN_AXES.items()}
        return shard(y, ("batch", "length", "embed")), self.replace(**new)


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


def for_step(layers, length: jax.Array, *, chunk: bool = False):
    """Every layer state of `layers` (any tree of them) set up for a call that leaves
    `length` `[B]` tokens in each row (`chunk`: a chunk appended to a non-empty
    cache); the model's step calls this before the layers run, and again with
    `chunk=False` on the states they return."""
    return jax.tree.map(lambda c: c.for_step(length, chunk=chunk) if isinstance(c, LayerCache)
                        else c, layers, is_leaf=lambda c: isinstance(c, LayerCache))
