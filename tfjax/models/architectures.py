"""The architecture table, the build-time name checks, `build`, `unrolled`, and the
bytes of a model's inference cache.

    model = build(cfg.model, rngs=nnx.Rngs(0))
    model = unrolled(model)      # the same model, every layer an unrolled block (decoding)
    cache_bytes(cfg.model, batch, length)   # abstract: nothing is allocated

`check_names` checks every registry-owned name of a config against the registries
before anything is built (each error names the field and the allowed values).
See docs/models.md.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.config import ModelConfig, model_config
from tfjax.models.decoder import DecoderLM
from tfjax.models.encoder import EncoderModel
from tfjax.models.encoder_decoder import EncoderDecoderModel
from tfjax.models.vision import VisionEncoder
from tfjax.models.vision_language import ImagePrefixLM
from tfjax.models.mllama import MllamaModel
from tfjax.models.speech import SpeechEncoderDecoderModel
from tfjax.models import caching, mup
from tfjax.models.layer_kinds import FFN_KINDS, LAYER_KINDS
from tfjax.models.stack import REMAT_POLICIES, LayerStack
from tfjax.nn.blocks import BLOCKS, PLACEMENTS
from tfjax.nn.quant import quantize
from tfjax.nn.ffn import ACTIVATIONS
from tfjax.nn.linear_attention import FEATURE_MAPS
from tfjax.nn.moe import MOE_IMPLEMENTATIONS
from tfjax.nn.norms import NORMS
from tfjax.nn.positions import POSITIONS, ROPE_LAYOUTS, ROPE_SCALINGS
from tfjax.ops.attention import IMPLEMENTATIONS
from tfjax.registry import Registry

__all__ = ["ARCHITECTURES", "build", "cache_bytes", "check_names", "kv_bytes_per_token",
           "model_class", "unrolled"]

ARCHITECTURES: Registry[type] = Registry("architecture")
ARCHITECTURES.register("decoder", DecoderLM)
ARCHITECTURES.register("encoder", EncoderModel)
ARCHITECTURES.register("encoder_decoder", EncoderDecoderModel)
ARCHITECTURES.register("vision", VisionEncoder)


def _one_of(field: str, value, allowed: Iterable[str]) -> None:
    allowed = tuple(dict.fromkeys(allowed))
    if value not in allowed:
        raise ValueError(f"{field}: got {value!r}; allowed: {', '.join(map(repr, allowed))}")


def check_names(cfg: ModelConfig, prefix: str = "model") -> ModelConfig:
    """Every registry-owned name of `cfg` is registered, and every layer kind fits
    the architecture; returns `cfg`."""
    p, c = prefix, cfg
    _one_of(f"{p}.arch", c.arch, ARCHITECTURES)
    _one_of(f"{p}.activation", c.activation, ACTIVATIONS)
    if c.vision.activation:  # an image tower's own
        _one_of(f"{p}.vision.activation", c.vision.activation, ACTIVATIONS)
    _one_of(f"{p}.norm", c.norm, NORMS)
    if c.attention.qk_norm_kind:
        _one_of(f"{p}.attention.qk_norm_kind", c.attention.qk_norm_kind, NORMS)
    _one_of(f"{p}.norm_placement", c.norm_placement, PLACEMENTS)
    _one_of(f"{p}.position", c.position, POSITIONS)
    _one_of(f"{p}.block", c.block, BLOCKS)
    _one_of(f"{p}.attention.impl", c.attention.impl, ("auto", *IMPLEMENTATIONS))
    _one_of(f"{p}.remat", c.remat, REMAT_POLICIES)
    for i, kind in enumerate(c.layer_pattern):
        _one_of(f"{p}.layer_pattern[{i}]", kind, LAYER_KINDS)
    for i, kind in enumerate(c.ffn_pattern):
        _one_of(f"{p}.ffn_pattern[{i}]", kind, FFN_KINDS)
    if c.position == "rope":
        _one_of(f"{p}.rope.layout", c.rope.layout, ROPE_LAYOUTS)
        _one_of(f"{p}.rope.scaling", c.rope.scaling, ROPE_SCALINGS)
    _one_of(f"{p}.moe.impl", c.moe.impl, MOE_IMPLEMENTATIONS)
    _one_of(f"{p}.linear.feature_map", c.linear.feature_map, FEATURE_MAPS)
    causal = [k for k in dict.fromkeys(c.layer_pattern) if LAYER_KINDS.get(k).decoder_only]
    if causal and c.arch != "decoder":
        raise ValueError(f"{p}.layer_pattern: {', '.join(map(repr, sorted(causal)))} layers are "
                         f"causal mixers for arch='decoder' (arch={c.arch!r})")
    _check_shared(c, p)
    a = c.attention
    for name, on in (("attention.differential", a.differential),
                     ("attention.value_residual", a.value_residual != "none"),
                     ("first_norm_residual", c.first_norm_residual)):  # they see the layer
        other = [k for k in dict.fromkeys(c.layer_pattern) if not LAYER_KINDS.get(k).variants]
        if on and other:
            carry = [k for k in LAYER_KINDS if LAYER_KINDS.get(k).variants]
            raise ValueError(f"{p}.{name}: {', '.join(map(repr, other))} layers cannot carry it; "
                             f"use layer kinds {', '.join(map(repr, carry))}")
    return cfg


def _check_shared(c: ModelConfig, p: str) -> None:
    """model.shared.num_blocks against the layers that use a shared block (those of a
    kind with `shared_block`): none without blocks, and every block used."""
    kinds = [k for k in dict.fromkeys(c.layer_pattern) if LAYER_KINDS.get(k).shared_block]
    uses = sum(c.layer_kind(i) in kinds for i in range(c.num_layers))
    M = c.shared.num_blocks
    if kinds and not M:
        raise ValueError(f"{p}.shared.num_blocks: layer_pattern has "
                         f"{', '.join(map(repr, kinds))} layers, which run a shared block: "
                         f"set num_blocks >= 1")
    if M and uses < M:
        have = [k for k in LAYER_KINDS if LAYER_KINDS.get(k).shared_block]
        raise ValueError(f"{p}.shared.num_blocks: {M} shared blocks but {uses} of the "
                         f"{c.num_layers} layers use one; add {', '.join(map(repr, have))} "
                         f"layers to layer_pattern or set num_blocks <= {uses}")


def model_class(cfg: ModelConfig) -> type:
    """The class `build` makes for `cfg`: its architecture's, or for a decoder with
    images (model.vision.image_size > 0) Llama-3.2-Vision where its layer_pattern has
    layers that attend to a context ("cross"), else the image-prefix decoder; for an
    encoder-decoder over log-mel features (model.audio.n_mels > 0) the speech model."""
    cls = ARCHITECTURES.get(cfg.arch, field="model.arch")
    if cls is DecoderLM and cfg.vision.image_size:
        if any(LAYER_KINDS.get(k).context for k in cfg.layer_pattern):
            return MllamaModel
        return ImagePrefixLM
    if cls is EncoderDecoderModel and cfg.audio.n_mels:
        return SpeechEncoderDecoderModel
    return cls


def build(model_cfg, *, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """A model from `cfg.model` (ConfigDict, dict or ModelConfig), checked first."""
    cfg = check_names(model_config(model_cfg))
    mup.check(cfg)
    model = model_class(cfg)(cfg, rngs=rngs or nnx.Rngs(0))
    model = mup.rescale_init(model, cfg)
    return quantize(model, cfg.quant, paths=cfg.quant_paths, exclude=cfg.quant_exclude)


def unrolled(model: nnx.Module) -> nnx.Module:
    """`model` with every layer an unrolled block (its config's `scan_layers=False`):
    the same function, every variable (parameters, RNG state, statistics) moved from
    the stacked cycles to per-layer arrays; dropout's mode as in `model`. A model
    without scanned cycles comes back as it is.

    For decoding. A scanned stack takes each layer's cache out of the stacked caches
    and writes it back every step, and XLA copies both ways (cache-sized copies each
    decode step: `experiments/results/attention_layer_tpu_aot_20261204.md`);
    unrolled layers update their own caches in place. Training keeps the scan
    (compile time flat in depth). The new arrays are copies: drop `model` after, or
    build unrolled in the first place (`tfjax.interop.hf.load(..., scan_layers=False)`).
    """
    stacks = {path: node.layout for path, node in nnx.iter_graph(model)
              if isinstance(node, LayerStack)}
    if not any(layout.num_cycles for layout in stacks.values()):
        return model
    drops = {node.deterministic for _, node in nnx.iter_graph(model)
             if isinstance(node, nnx.Dropout)}
    if len(drops) > 1:
        raise ValueError("unrolled: the model's dropout layers are in mixed modes; call "
                         "model.eval() or model.train() first")
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig) or type(model) is not model_class(config):
        raise ValueError(f"unrolled: takes a model `tfjax.models.build` made, not a "
                         f"{type(model).__name__} (an HF encoder: its `.model`, or "
                         f"hf.load(..., scan_layers=False))")
    cfg = dataclasses.replace(config, scan_layers=False)
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))
    graphdef, target = nnx.split(abstract)
    want = dict(nnx.to_flat_state(target))
    moved = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        for new_path, value in _unrolled_paths(path, var.get_value(), stacks):
            moved[new_path] = value
    if set(moved) != set(want):
        odd = sorted(map(str, set(moved) ^ set(want)))
        raise ValueError(f"unrolled: the model's state does not map onto the unrolled "
                         f"{cfg.arch} model of its config ({len(odd)} paths differ, e.g. "
                         f"{odd[0]}); was the model built from model.config?")
    shape = lambda x: tuple(jax.numpy.shape(x))
    bad = [p for p, v in moved.items() if shape(v) != shape(want[p].get_value())]
    if bad:
        raise ValueError(f"unrolled: {bad[0]} has shape {shape(moved[bad[0]])}, the unrolled "
                         f"model's {shape(want[bad[0]].get_value())}")
    # the unrolled model's variables (their metadata: no "layers" axis) with the values
    out = nnx.merge(graphdef, nnx.from_flat_state(
        {p: want[p].replace(v) for p, v in moved.items()}))
    if drops == {True}:
        out.eval()
    elif drops == {False}:
        out.train()
    return out


def cache_bytes(cfg: ModelConfig, batch: int, length: int, *, dtype=None,
                encoder_len: int = 0) -> int:
    """Bytes of the K/V (and other float state) of a cache of `batch` rows of `length`
    tokens for the model of `cfg`: its layers' `init_state`s, abstract (nothing is
    allocated; counters excluded). Local layers count their W+1 slots, cross-attention
    (encoder_len > 0) its encoder's (or the images') K/V. An 8-bit cache (`model.kv_quant`) counts its
    8-bit K/V and their per token and kv head scales (in `dtype`)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    cross = cfg.arch == "encoder_decoder"
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))
    stack = model.decoder if cross else getattr(model, "text", model).layers  # MllamaModel
    context = any(LAYER_KINDS.get(k).context for k in cfg.layer_pattern)
    tree = jax.eval_shape(lambda: caching.layer_states(
        cfg, stack, batch, length, dtype, max(encoder_len, 1) if cross or context else None))
    total = 0
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.dtype == jnp.int8:  # kv_quant
            total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    if cross and not encoder_len:  # counted with S=1 above; take it out
        total -= (cfg.num_layers * batch * cfg.kv_heads * (cfg.head_size + cfg.value_head_size)
                  * dtype.itemsize)
    elif context and not encoder_len:  # the "cross" layers' image K/V, counted with S=1
        n = sum(LAYER_KINDS.get(cfg.layer_kind(i)).context for i in range(cfg.num_layers))
        total -= n * batch * cfg.kv_heads * (cfg.head_size + cfg.value_head_size) * dtype.itemsize
    return total


def kv_bytes_per_token(cfg: ModelConfig, *, dtype=None) -> int:
    """The bytes one more token adds to a short cache: one token's cache if every
    layer were global (for K/V layers the textbook layers x kv heads x (K's + V's
    head dims) x bytes; MLA layers their latent; recurrent states add nothing, and
    local layers cost less past W)."""
    return cache_bytes(cfg, 1, 2, dtype=dtype) - cache_bytes(cfg, 1, 1, dtype=dtype)


def _unrolled_paths(path: tuple, value, stacks: dict):
    """Where a state leaf of a scanned model goes in its unrolled twin: position j of
    cycle c (`(stack, "cycles", "layers", j, ...)`, index c of the stacked axis) is
    block c * L + j; unrolled block b follows the scanned layers; the rest stays."""
    for prefix, layout in stacks.items():
        n = len(prefix)
        if path[:n] != prefix or len(path) <= n:
            continue
        scanned = layout.num_cycles * layout.cycle_length
        if path[n] == "cycles":
            j, rest = path[n + 2], path[n + 3:]
            return [((*prefix, "blocks", c * layout.cycle_length + j, *rest), value[c])
                    for c in range(layout.num_cycles)]
        if path[n] == "blocks":
            return [((*prefix, "blocks", scanned + path[n + 1], *path[n + 2:]), value)]
    return [(path, value)]
