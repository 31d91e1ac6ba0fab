"""What every architecture shares: the layer stack (scanned over repeats of the
per-layer pattern), the block of each layer, the embedder and the output head.

`LayerStack(cfg, rngs, num_layers=)`: `x [B, T, D] -> [B, T, D]` over the layout's
cycles (parameters stacked, applied with `nnx.scan`: compile time flat in depth) and
unrolled blocks, each layer built by `build_block` from its layer kind and ffn kind;
it owns the shared blocks (Zamba2) and takes each kind's masks and biases, computed
once a call. `REMAT_POLICIES`: what a scanned layer's backward keeps (`model.remat`).
See docs/models.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.models.layer_kinds import (FFN_KINDS, LAYER_KINDS, attention, shared_block,
                                      shared_block_use)
from tfjax.models.layout import StackLayout
from tfjax.nn import hooks
from tfjax.nn import positions as pos_lib
from tfjax.nn.blocks import TransformerBlock
from tfjax.nn.norms import make_norm
from tfjax.nn.positions import default_positions
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.registry import Registry

__all__ = ["REMAT_POLICIES", "LayerStack", "Embedder", "build_block", "build_norm",
           "default_positions", "dtype_of"]

# Named rematerialisation policies for the scanned layer body (`model.remat`): what
# the backward of a layer keeps from its forward; the rest it recomputes from the
# layer's input. Names are set where the values are made: "attn_q", "attn_k",
# "attn_v" (q, k, v as the attention reads them, after QK-norm and RoPE:
# `tfjax.nn.attention.MultiHeadAttention.project`), "attn_out" and "attn_lse" (the
# tiled attentions' output and logsumexp, the residuals of their backward:
# `tfjax.ops.vjp`; keeping both is what spares the forward kernel in the backward).
# "*_offload" keeps the same values in host memory (`save_and_offload_only_these_names`,
# for platforms with pinned host memory: TPU, GPU). Measured per chip:
# experiments/results/vs_maxtext.md.
_ATTN, _QKV = ("attn_out", "attn_lse"), ("attn_q", "attn_k", "attn_v")
_cp = jax.checkpoint_policies


def _offload(names):
    return _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=names,
        offload_src="device", offload_dst="pinned_host")


REMAT_POLICIES: Registry = Registry("remat policy")
REMAT_POLICIES.register("none", None)  # no checkpointing: keep everything
REMAT_POLICIES.register("full", _cp.nothing_saveable)
REMAT_POLICIES.register("dots", _cp.dots_saveable)
REMAT_POLICIES.register("dots_no_batch", _cp.dots_with_no_batch_dims_saveable)
REMAT_POLICIES.register("attn", _cp.save_only_these_names(*_ATTN))
REMAT_POLICIES.register("qkv_attn", _cp.save_only_these_names(*_QKV, *_ATTN))
REMAT_POLICIES.register("dots_attn", _cp.save_from_both_policies(
    _cp.dots_with_no_batch_dims_saveable, _cp.save_only_these_names(*_ATTN)))
REMAT_POLICIES.register("attn_offload", _offload(_ATTN))
REMAT_POLICIES.register("qkv_attn_offload", _offload(_QKV + _ATTN))


def dtype_of(name: str):
    return jnp.dtype(name)


def build_norm(cfg: ModelConfig, rngs: nnx.Rngs, dim: int | None = None) -> nnx.Module:
    return make_norm(cfg.norm, dim or cfg.d_model, eps=cfg.norm_eps, use_bias=cfg.norm_bias,
                     dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)


def build_block(cfg: ModelConfig, rngs: nnx.Rngs, *, cross: bool = False,
                layer: int = 0) -> TransformerBlock:
    """Layer `layer` as the config describes it: its layer kind's record builds the
    mixer, its ffn kind's the feed-forward (or none); `cross` adds the decoder's
    cross-attention."""
    ffn = FFN_KINDS.get(cfg.ffn_kind(layer), field="model.ffn_pattern").build(cfg, rngs)
    kind = LAYER_KINDS.get(cfg.layer_kind(layer), field="model.layer_pattern")
    return TransformerBlock(
        attn=kind.mixer(cfg, rngs, positions=kind.positions), ffn=ffn,
        make_norm=lambda: build_norm(cfg, rngs),
        cross_attn=attention(cfg, rngs, positions=False) if cross else None,
        placement=cfg.norm_placement, parallel=cfg.block == "parallel",
        parallel_shared_norm=cfg.parallel_shared_norm,
        first_norm_residual=cfg.first_norm_residual, dropout_rate=cfg.dropout_rate,
        mixer_input=shared_block_use(cfg, rngs) if kind.shared_block else None,
        mixer_context=kind.context, gated=kind.context, rngs=rngs)


class _Cycle(nnx.Module):
    """One repeat of the layer pattern (the scanned unit)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, cross: bool, length: int):
        self.layers = nnx.List([build_block(cfg, rngs, cross=cross, layer=i)
                                for i in range(length)])


class LayerStack(nnx.Module):
    """`num_layers` blocks laid out as `self.layout` says: `self.cycles.layers[j]`
    (parameters stacked over the scanned cycles) and `self.blocks[j]` (unrolled);
    `self.pattern` is the layer kinds of one cycle.

    Depth inputs (`model.attention.differential`, `model.attention.value_residual`,
    `model.first_norm_residual`): every block then gets
    its layer index `layer` (an int, traced under the scan: cycle * cycle length +
    position) and, with the value residual, `first_values`, the first layer's values
    of the same tokens (`TransformerBlock.mixer_values` of layer 0's input, carried
    through the scan; inside the scan it is projected at position 0 of every cycle
    and kept from cycle 0, one extra [D, K, Hv] projection per cycle).

    `self.shared`: the shared blocks (`model.shared`), parameters stacked over
    `shared.num_blocks`, or None; layers of a kind with `shared_block` get
    `shared=` (their block) and `embeddings=` (the stack's input)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, num_layers: int, cross: bool = False):
        self.layout = layout = StackLayout.of(cfg, num_layers)
        self.remat = cfg.remat
        self.depth_inputs = (cfg.attention.differential or cfg.attention.value_residual != "none"
                             or cfg.first_norm_residual)
        self.value_residual = cfg.attention.value_residual != "none"
        if layout.num_cycles:
            @nnx.split_rngs(splits=layout.num_cycles)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def create(rngs):
                return _Cycle(cfg, rngs, cross=cross, length=layout.cycle_length)

            self.cycles = create(rngs)
        else:
            self.cycles = None
        self.blocks = nnx.List([build_block(cfg, rngs, cross=cross, layer=layout.block_layer(j))
                                for j in range(layout.num_blocks)])
        uses = [LAYER_KINDS.get(layout.kind(i)).shared_block for i in range(num_layers)]
        self.num_shared = cfg.shared.num_blocks if any(uses) else 0
        if self.num_shared:
            @nnx.split_rngs(splits=self.num_shared)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def create_shared(rngs):
                return shared_block(cfg, rngs)

            self.shared = create_shared(rngs)
        else:
            self.shared = None
        # use index of layer i = the shared-block layers before it (static tables)
        self.use_before = tuple(sum(uses[:i]) for i in range(num_layers))
        L = layout.cycle_length
        self.uses_per_cycle = sum(uses[:L]) if layout.num_cycles else 0

    @property
    def pattern(self) -> tuple[str, ...]:
        return self.layout.pattern

    def _block_kind(self, j: int) -> str:
        return self.layout.kind(self.layout.block_layer(j))

    def _depth(self, block, x, layer, first, cycle=None):
        """(the depth kwargs of the block at `layer`, the first layer's values) given
        its input x and the first values so far; `cycle`: the traced cycle index of
        a scanned block at position 0 (layer 0 is cycle 0's)."""
        if not self.depth_inputs:
            return {}, first
        if self.value_residual and cycle is not None:
            first = jnp.where(cycle == 0, block.mixer_values(x), first)
        elif self.value_residual and isinstance(layer, int) and layer == 0:  # unrolled
            first = block.mixer_values(x)
        return dict(layer=layer, first_values=first), first

    def _shared_kwargs(self, shared, x0, kind, j, cycle=None):
        """The kwargs of a layer of `kind` for its shared block: {} for a kind without
        one, else its block (of the stacked `shared`) and the embeddings `x0`. The
        layer is unrolled block j, or position j of scanned cycle `cycle` (traced)."""
        if not LAYER_KINDS.get(kind).shared_block:
            return {}
        M = self.num_shared
        if cycle is None:  # unrolled: layer block_layer(j)
            m = self.use_before[self.layout.block_layer(j)] % M
        elif M == 1 or self.uses_per_cycle % M == 0:  # the same block in every cycle
            m = self.use_before[j] % M
        else:
            m = (cycle * self.uses_per_cycle + self.use_before[j]) % M
        graphdef, state = nnx.split(shared)
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[m], state))
        return dict(shared=block, embeddings=x0)

    def _first_init(self, x):
        """The carried first-layer values before layer 0 (zeros of their shape)."""
        if not (self.value_residual and self.cycles is not None):
            return None
        block = self.cycles.layers[0]
        K, Hv = block.attn.num_kv_heads, block.attn.v_head_dim
        return jnp.zeros((*x.shape[:2], K, Hv), x.dtype)

    def __call__(self, x, *, masks: dict, biases: dict, state=None, slots: dict | None = None,
                 **kwargs):
        """`masks[kind]` / `biases[kind]` are the mask and position bias of layers of
        that kind (`attention_inputs`); kwargs go to every block.

        Decoding: with `state` (`{"cycles": per-pattern-position states stacked over
        cycles, "blocks": per unrolled block}`, `tfjax.models.caching`) and `slots[kind]`
        (the step's slots of layers of that kind) each block gets its state (the
        stacked ones scanned alongside the layers) and this returns `(x, new_state)`.
        """
        if state is not None:
            return self._call_cached(x, masks, biases, state, slots, kwargs)
        policy = REMAT_POLICIES.get(self.remat, field="model.remat")

        def apply(block, x, mask, bias, depth):
            return block(x, mask=mask, bias=bias, **depth, **kwargs)

        # A hook session (tfjax.interp) keeps values from inside the blocks, which
        # must not be tracers of a remat; remat changes no forward value.
        recording = hooks.recording()
        if self.remat != "none" and not recording:
            apply = nnx.remat(apply, policy=policy)

        first, L, x0 = self._first_init(x), self.layout.cycle_length, x
        rotary = self._rotary(kwargs.get("positions"))
        if self.cycles is not None:
            pattern, C = self.pattern, self.layout.num_cycles
            frame = hooks.Frame() if recording else None

            def body(carry, cycle, shared, c):
                x, first = carry
                for j, (kind, block) in enumerate(zip(pattern, cycle.layers)):
                    depth, first = self._depth(block, x, c * L + j, first,
                                               cycle=c if j == 0 else None)
                    depth.update(self._shared_kwargs(shared, x0, kind, j, cycle=c))
                    depth.update(rotary(block))
                    with hooks.layer_scope("blocks", range(j, C * L, L), c, frame):
                        x = apply(block, x, masks[kind], biases[kind], depth)
                # the hooked values kept, stacked over the cycles by the scan
                return ((x, first), frame.values) if recording else (x, first)

            out = nnx.scan(body, in_axes=(nnx.Carry, 0, None, 0),
                           out_axes=(nnx.Carry, 0) if recording else nnx.Carry,
                           transform_metadata={nnx.PARTITION_NAME: "layers"})(
                               (x, first), self.cycles, self.shared, self._cycle_index())
            if recording:
                out, kept = out
                frame.emit(kept)
            x, first = out
        for j, block in enumerate(self.blocks):
            kind = self._block_kind(j)
            depth, first = self._depth(block, x, self.layout.block_layer(j), first)
            depth.update(self._shared_kwargs(self.shared, x0, kind, j))
            depth.update(rotary(block))
            with hooks.layer_scope("blocks", (self.layout.block_layer(j),)):
                x = apply(block, x, masks[kind], biases[kind], depth)
        return x

    def _rotary(self, positions):
        """block -> the kwargs giving its self-attention the RoPE tables of `positions`:
        `{"rope_tables": rope.tables(positions)}`, or {} for a mixer without RoPE (or no
        positions). Each distinct RoPE's tables are computed here, once a call, outside
        the layer scan and the remat: inside, every layer recomputed their sin and cos
        (XLA fuses them into the rotations, per head; again in the backward;
        experiments/results/bench_train_cpu.md)."""
        blocks = list(self.blocks) + (list(self.cycles.layers) if self.cycles is not None else [])
        ropes = {getattr(b.attn, "rope", None) for b in blocks} - {None}  # attention's, MLA's
        tables = {} if positions is None else {r: r.tables(positions) for r in ropes}

        def kwargs(block):
            rope = getattr(block.attn, "rope", None)
            return {"rope_tables": tables[rope]} if rope in tables else {}

        return kwargs

    def _cycle_index(self):
        return jnp.arange(self.layout.num_cycles, dtype=jnp.int32)

    def _call_cached(self, x, masks, biases, state, slots, kwargs):
        pattern, L = self.pattern, self.layout.cycle_length

        def apply(block, x, kind, c, depth):
            return block(x, mask=masks[kind], bias=biases[kind], state=c, slots=slots[kind],
                         **depth, **kwargs)

        first, x0 = self._first_init(x), x
        cycles = state.get("cycles")
        if self.cycles is not None:
            def body(carry, cycle, shared, cc, i):
                x, first = carry
                new = []
                for j, (kind, block, c) in enumerate(zip(pattern, cycle.layers, cc)):
                    depth, first = self._depth(block, x, i * L + j, first,
                                               cycle=i if j == 0 else None)
                    depth.update(self._shared_kwargs(shared, x0, kind, j, cycle=i))
                    x, c = apply(block, x, kind, c, depth)
                    new.append(c)
                return (x, first), tuple(new)

            (x, first), cycles = nnx.scan(
                body, in_axes=(nnx.Carry, 0, None, 0, 0), out_axes=(nnx.Carry, 0),
                transform_metadata={nnx.PARTITION_NAME: "layers"})(
                    (x, first), self.cycles, self.shared, tuple(cycles), self._cycle_index())
        blocks = []
        for j, (block, c) in enumerate(zip(self.blocks, state["blocks"])):
            depth, first = self._depth(block, x, self.layout.block_layer(j), first)
            depth.update(self._shared_kwargs(self.shared, x0, self._block_kind(j), j))
            x, c = apply(block, x, self._block_kind(j), c, depth)
            blocks.append(c)
        return x, {"cycles": cycles, "blocks": tuple(blocks)}


class Embedder(nnx.Module):
    """Token (+ learned/sinusoidal position, + token-type) embeddings in; logits out.

    The output projection is the transposed embedding when tied (Press & Wolf
    2017), else its own `[D, V]` matrix; then an optional final soft-cap.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        self.d_model, self.dtype = cfg.d_model, dt
        self.position = cfg.position
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.logits_scale, self.final_softcap = cfg.logits_multiplier, cfg.final_softcap
        normal = nnx.initializers.normal(cfg.init_std)
        self.tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                                embedding_init=with_logical_axes(normal, ("vocab", "embed")), rngs=rngs)
        self.positions = (pos_lib.LearnedPositions(cfg.max_len, cfg.d_model, init_std=cfg.init_std,
                                                   param_dtype=pdt, rngs=rngs)
                          if cfg.position == "learned" else None)
        self.token_types = (nnx.Embed(cfg.type_vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                                      embedding_init=with_logical_axes(normal, (None, "embed")), rngs=rngs)
                            if cfg.type_vocab_size else None)
        self.norm = build_norm(cfg, rngs) if cfg.embed_norm else None
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs) if cfg.dropout_rate > 0 else None
        self.head = (None if cfg.tie_embeddings else
                     nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt,
                                param_dtype=pdt, kernel_init=with_logical_axes(normal, ("embed", "vocab")),
                                rngs=rngs))

    def __call__(self, tokens, positions, token_types=None):
        x = hooks.hook("hook_embed", self.tokens(tokens) * jnp.asarray(self.scale, self.dtype))
        if self.position == "sinusoidal":
            x = x + hooks.hook("hook_pos_embed", pos_lib.sinusoidal_embedding(
                positions, self.d_model, dtype=x.dtype))
        elif self.positions is not None:
            x = x + hooks.hook("hook_pos_embed", self.positions(positions).astype(x.dtype))
        if self.token_types is not None:
            types = jnp.zeros_like(tokens) if token_types is None else token_types
            x = x + self.token_types(types)
        if self.norm is not None:
            x = self.norm(x)
        if self.dropout is not None:
            x = self.dropout(x)
        return shard(x, ("batch", "length", "embed"))

    def logits(self, x):
        """Final hidden `[B,T,D]` -> logits `[B,T,V]` (fp32)."""
        if self.logits_scale != 1.0:
            x = x * self.logits_scale
        logits = self.tokens.attend(x) if self.head is None else self.head(x)
        logits = logits.astype(jnp.float32)
        if self.final_softcap:
            logits = self.final_softcap * jnp.tanh(logits / self.final_softcap)
        return shard(logits, ("batch", "length", "vocab"))
