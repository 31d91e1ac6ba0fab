"""Llama-3.2-Vision (`MllamaForConditionalGeneration`, model_type "mllama"): a Llama text
model whose `cross_attention_layers` are tfjax's "cross" layers, the tiled vision model
(`tfjax.models.mllama_vision`) and the projector, as `tfjax.models.mllama.MllamaModel`.

    model = from_hf(config_dict, tensors)      # tensors: {HF name: array}
    model, cfg = tfjax.interop.hf.load(path)   # the same, from a checkpoint directory
    export(model, path)                        # what transformers' from_pretrained reads

One `ModelConfig` (the tower in `model.vision`) built by `tfjax.models.build`. HF's
embedding has 8 extra rows (`model.vision.image_token_rows`); the head is padded with zero
rows to its width and the logits cut back to `vocab_size`. See docs/multimodal.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.config import ModelConfig, model_config
from tfjax.config.mllama import MllamaVisionConfig, aspect_ratios
from tfjax.interop.families import Family, llama
from tfjax.interop.hf_invert import hf_shapes
from tfjax.interop.safetensors_io import write_file
from tfjax.interop.tensor_mapping import (Weights, attention_weights, heads_in, heads_out,
                                          norm_weights, qk_norm_weights, swiglu_weights)
from tfjax.models.architectures import build
from tfjax.models.layout import StackLayout
from tfjax.models.mllama import MllamaModel

__all__ = ["EXTRA_ROWS", "FAMILY", "config", "export", "from_hf", "layer_pattern", "to_hf",
           "vision_config", "weights"]

EXTRA_ROWS = 8  # HF's embed_tokens: vocab_size + 8 rows
_T, _V = "model.language_model.", "model.vision_model."


def layer_pattern(n: int, cross: list[int]) -> tuple[str, ...]:
    """The shortest `model.layer_pattern` whose cycle puts "cross" at exactly the
    indices `cross` of `n` layers (HF's cross_attention_layers)."""
    bad = [i for i in cross if not 0 <= i < n]
    if bad:
        raise ValueError(f"text_config.cross_attention_layers: {bad} are not layers of the "
                         f"{n}-layer text model")
    full = tuple("cross" if i in cross else "global" for i in range(n))
    for p in range(1, n + 1):
        if all(full[i] == full[i % p] for i in range(n)):
            return full[:p]
    return full


def config(hf: dict) -> dict:
    """The `ModelConfig` fields: the text model's, and its vision tower in `vision`."""
    t = dict(hf["text_config"])
    if t.get("dropout", 0.0):
        raise NotImplementedError("text_config.dropout > 0 is not mapped (mllama)")
    c = llama.config(dict(t, attention_bias=False, mlp_bias=False))
    c["vocab_size"] = t["vocab_size"] + EXTRA_ROWS
    c["tie_embeddings"] = bool(t.get("tie_word_embeddings", False))
    c["layer_pattern"] = layer_pattern(t["num_hidden_layers"], list(t["cross_attention_layers"]))
    c["attention"].pop("sliding_window", None)
    c["vision"] = vision_config(hf)
    return c


def vision_config(hf: dict) -> dict:
    """The `model.vision` fields of HF's vision_config (the tiled tower)."""
    v = hf["vision_config"]
    if v.get("hidden_act", "gelu") != "gelu":
        raise NotImplementedError(f"vision_config.hidden_act={v['hidden_act']!r} (mllama: gelu)")
    out = dict(d_model=v["hidden_size"], num_layers=v["num_hidden_layers"],
               num_global_layers=v["num_global_layers"], num_heads=v["attention_heads"],
               d_ff=v["intermediate_size"], image_size=v["image_size"],
               patch_size=v["patch_size"], channels=v["num_channels"],
               max_num_tiles=v["max_num_tiles"],
               max_aspect_ratio_id=len(v["supported_aspect_ratios"]),
               intermediate_layers=tuple(v["intermediate_layers_indices"]),
               norm_eps=v["norm_eps"], activation="gelu", image_token_rows=EXTRA_ROWS)
    want = v["hidden_size"] * (len(v["intermediate_layers_indices"]) + 1)
    if v.get("vision_output_dim", want) != want:
        raise ValueError(f"vision_config.vision_output_dim={v['vision_output_dim']} is not "
                         f"hidden_size * (len(intermediate_layers_indices) + 1) = {want}")
    return out


def _text_weights(w: Weights, cfg: ModelConfig) -> dict:
    V = cfg.vocab_size
    out = {("embed", "tokens", "embedding"): w[_T + "embed_tokens.weight"]}
    head = w["lm_head.weight"]
    out[("embed", "head", "kernel")] = np.concatenate(
        [head, np.zeros((V - head.shape[0], head.shape[1]), head.dtype)]).T
    out[("final_norm", "scale")] = w[_T + "norm.weight"]
    for i in range(cfg.num_layers):
        p, L = f"{_T}layers.{i}.", ("layers", i)
        out.update(norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(norm_weights(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        out.update(swiglu_weights(w, p + "mlp", L + ("ffn",), False))
        if cfg.layer_kind(i) == "cross":
            out.update(attention_weights(w, p + "cross_attn.", L + ("attn",), cfg))
            out.update(qk_norm_weights(w, p + "cross_attn.", L + ("attn",), cfg))
            out[L + ("attn_gate",)] = w[p + "cross_attn_attn_gate"].reshape(())
            out[L + ("ffn_gate",)] = w[p + "cross_attn_mlp_gate"].reshape(())
        else:
            out.update(attention_weights(w, p + "self_attn.", L + ("attn",), cfg))
    return out


def _vision_block(w: Weights, p: str, B: tuple, heads: int, gated: bool) -> dict:
    out = {}
    for ours, theirs in (("attn_norm", "input_layernorm"),
                         ("ffn_norm", "post_attention_layernorm")):
        out[B + (ours, "scale")] = w[p + theirs + ".weight"]
        out[B + (ours, "bias")] = w[p + theirs + ".bias"]
    for n in "qkv":
        W = w[f"{p}self_attn.{n}_proj.weight"]
        out[B + ("attn", n, "kernel")] = heads_in(W, heads, W.shape[0] // heads)
    W = w[p + "self_attn.o_proj.weight"]
    out[B + ("attn", "o", "kernel")] = heads_out(W, heads, W.shape[1] // heads)
    for ours, theirs in (("wi", "fc1"), ("wo", "fc2")):
        out[B + ("ffn", ours, "kernel")] = w[f"{p}mlp.{theirs}.weight"].T
        out[B + ("ffn", ours, "bias")] = w[f"{p}mlp.{theirs}.bias"]
    if gated:
        out[B + ("attn_gate",)] = w[p + "gate_attn"].reshape(())
        out[B + ("ffn_gate",)] = w[p + "gate_ffn"].reshape(())
    return out


def _vision_weights(w: Weights, v: MllamaVisionConfig) -> dict:
    conv = w[_V + "patch_embedding.weight"]  # [D, C, p, p]
    out = {("vision", "patch_embedding"): conv.reshape(conv.shape[0], -1).T,
           ("vision", "class_embedding"): w[_V + "class_embedding"]}
    g = ("vision", "gated_positional_embedding")
    out[g + ("embedding",)] = w[_V + "gated_positional_embedding.embedding"]
    out[g + ("tile_embedding", "embedding")] = w[
        _V + "gated_positional_embedding.tile_embedding.weight"]
    out[g + ("gate",)] = w[_V + "gated_positional_embedding.gate"].reshape(())
    for name in ("pre_tile_positional_embedding", "post_tile_positional_embedding"):
        out[("vision", name, "embedding", "embedding")] = w[f"{_V}{name}.embedding.weight"]
        out[("vision", name, "gate")] = w[f"{_V}{name}.gate"].reshape(())
    for name in ("layernorm_pre", "layernorm_post"):
        out[("vision", name, "scale")] = w[f"{_V}{name}.weight"]
        out[("vision", name, "bias")] = w[f"{_V}{name}.bias"]
    for stack, n, gated in (("transformer", v.num_layers, False),
                            ("global_transformer", v.num_global_layers, True)):
        for i in range(n):
            out.update(_vision_block(w, f"{_V}{stack}.layers.{i}.", ("vision", stack, i),
                                     v.num_heads, gated))
    out[("projector", "kernel")] = w["model.multi_modal_projector.weight"].T
    out[("projector", "bias")] = w["model.multi_modal_projector.bias"]
    return out


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    """`{our path: array}` of a whole MllamaForConditionalGeneration: the text model's
    per-layer paths `("layers", i, ...)`, the rest as `MllamaModel` holds them."""
    return {**_text_weights(w, cfg), **_vision_weights(w, MllamaVisionConfig.of(cfg))}


# the names save_pretrained writes (and the Hub's checkpoints hold) -> the module's
_SAVED = (("language_model.model.", "model.language_model."),
          ("language_model.lm_head.", "lm_head."), ("vision_model.", "model.vision_model."),
          ("multi_modal_projector.", "model.multi_modal_projector."))


class _Renamed(Mapping):
    """A checkpoint's tensors under the module's names (`_SAVED`), read lazily."""

    def __init__(self, tensors):
        self.tensors, self.names = tensors, {}
        for name in tensors:
            new = next((new + name[len(old):] for old, new in _SAVED if name.startswith(old)),
                       name)
            self.names[new] = name

    def __getitem__(self, name):
        return self.tensors[self.names[name]]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def _place(cfg: ModelConfig, key: tuple) -> tuple[tuple, int | None]:
    """Our key -> (the MllamaModel state path, index in a scanned stack)."""
    if key[0] == "layers":
        _, i, *rest = key
        where = StackLayout.of(cfg).where(i)
        if where[0] == "cycles":
            return ("text", "layers", "cycles", "layers", where[1], *rest), where[2]
        return ("text", "layers", "blocks", where[1], *rest), None
    if key[0] in ("embed", "final_norm"):
        return ("text", *key), None
    return key, None


def from_hf(hf: dict, tensors, *, scan_layers: bool = True, dtype: str = "float32") -> MllamaModel:
    """An `MllamaModel` of a `config.json` dict and its tensors (`{HF name: array}`);
    every tensor is used and every parameter given, or a ValueError names it."""
    if hf.get("model_type") != "mllama":
        raise ValueError(f"config.json model_type: expected 'mllama', got {hf.get('model_type')!r}")
    dtype = str(jnp.dtype(dtype))
    cfg = model_config(dict(config(hf), scan_layers=scan_layers, dtype=dtype, param_dtype=dtype))
    w = Weights(_Renamed(tensors))
    arrays = weights(w, cfg, hf)
    left = w.leftovers()
    if left:
        raise NotImplementedError(f"mllama: checkpoint tensors not mapped: {', '.join(left[:8])}")
    abstract = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))  # an MllamaModel
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    values: dict = {}
    for key, arr in arrays.items():
        path, idx = _place(cfg, key)
        if path not in flat:
            raise ValueError(f"mllama: {key}: no parameter {path} in the tfjax model")
        if idx is None:
            values[path] = np.asarray(arr)
        else:
            values.setdefault(path, {})[idx] = np.asarray(arr)
    out = []
    for path, var in flat.items():
        if path not in values:
            raise ValueError(f"mllama: parameter {'.'.join(map(str, path))} not in the checkpoint")
        v = values[path]
        if isinstance(v, dict):
            v = np.stack([v[c] for c in range(len(v))])
        shape = var.get_value().shape
        if v.shape != shape:
            raise ValueError(f"mllama: {'.'.join(map(str, path))}: checkpoint shape {v.shape} "
                             f"!= tfjax {shape}")
        out.append((path, var.replace(jnp.asarray(v, var.get_value().dtype))))
    model = nnx.merge(graphdef, nnx.from_flat_state(out))
    model.eval()
    return model


FAMILY = Family(model_types=("mllama",), config=config, weights=weights, build=from_hf)


# --------------------------------------------------------------------------- #
# Export: the mapping run backwards on a probe of element indices.
# --------------------------------------------------------------------------- #


def to_hf(model: MllamaModel) -> dict:
    """The config.json dict of `model` (the inverse of `config` and `vision_config`), or
    a ValueError naming a field MLlama cannot hold."""
    cfg, v = model.config, model.vision_config
    text = llama.checked_to_hf(cfg, "mllama", "mllama_text_model", "MllamaForCausalLM",
                               kinds=("global", "cross"))
    if cfg.head_size * cfg.num_heads != cfg.d_model:
        raise ValueError(f"export: mllama's head dim is d_model / num_heads; got "
                         f"model.head_dim={cfg.head_size}")
    if cfg.vision.image_token_rows != EXTRA_ROWS:
        raise ValueError(f"export: mllama's embedding has vocab_size + {EXTRA_ROWS} rows; set "
                         f"model.vision.image_token_rows={EXTRA_ROWS}, got "
                         f"{cfg.vision.image_token_rows}")
    for k in ("architectures", "head_dim", "attention_dropout", "dtype"):
        text.pop(k)
    # token ids are the tokenizer's; MllamaTextConfig needs an int bos (Llama 3's, in range)
    text.update(bos_token_id=128000 if model.text_vocab > 128000 else 0)
    text.update(vocab_size=model.text_vocab, cross_attention_layers=[
        i for i in range(cfg.num_layers) if cfg.layer_kind(i) == "cross"])
    vision = dict(hidden_size=v.d_model, num_hidden_layers=v.num_layers,
                  num_global_layers=v.num_global_layers, attention_heads=v.num_heads,
                  intermediate_size=v.d_ff, image_size=v.image_size, patch_size=v.patch_size,
                  num_channels=v.num_channels, max_num_tiles=v.max_num_tiles,
                  norm_eps=v.norm_eps, hidden_act=v.activation, vision_output_dim=v.output_dim,
                  intermediate_layers_indices=list(v.intermediate_layers),
                  supported_aspect_ratios=_aspect_ratios(v))
    return dict(model_type="mllama", architectures=["MllamaForConditionalGeneration"],
                text_config=text, vision_config=vision, dtype=cfg.param_dtype)


def _aspect_ratios(v: MllamaVisionConfig) -> list[list[int]]:
    """HF's supported_aspect_ratios for max_num_tiles, which must count max_aspect_ratio_id."""
    ratios = aspect_ratios(v.max_num_tiles)
    if len(ratios) != v.max_aspect_ratio_id:
        raise ValueError(f"export: vision.max_aspect_ratio_id={v.max_aspect_ratio_id} is not "
                         f"the {len(ratios)} aspect ratios of max_num_tiles={v.max_num_tiles}")
    return ratios


def export(model: MllamaModel, path: str) -> dict:
    """Write `model` as a transformers checkpoint directory (config.json and
    model.safetensors, the Hub's tensor names); returns the config dict. The mapping is
    run on a probe whose elements are their own indices, so each of our parameters'
    elements lands where `from_hf` read it (the checkpoint is built in host memory)."""
    hf = to_hf(model)
    shapes = hf_shapes(hf)
    probe, start = {}, 1  # index 0: the head's zero padding rows, written nowhere
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64))
        probe[name] = np.arange(start, start + size, dtype=np.float64).reshape(shape)
        start += size
    w = Weights(_Renamed(probe))
    cfg = model.config
    arrays = weights(w, cfg, hf)
    left = w.leftovers()
    if left:
        raise ValueError(f"export: the mllama mapping leaves tensors unwritten: {left[:8]}")
    flat = {k: np.asarray(x.get_value())
            for k, x in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out, written = np.zeros(start, np.float64), np.zeros(start, bool)
    for key, index in arrays.items():
        where, c = _place(cfg, key)
        value = flat[where] if c is None else flat[where][c]
        index = np.asarray(index).astype(np.int64).ravel()
        keep = index > 0
        out[index[keep]] = np.asarray(value, np.float64).ravel()[keep]
        written[index[keep]] = True
    if not written[1:].all():
        raise ValueError("export: the mllama mapping does not write every checkpoint element")
    dtype = jnp.dtype(cfg.param_dtype)
    tensors, start = {}, 1
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64))
        tensors[name] = out[start:start + size].reshape(shape).astype(dtype)
        start += size
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    write_file({n: (t.shape, t.dtype) for n, t in tensors.items()}, tensors.__getitem__,
               os.path.join(path, "model.safetensors"))
    return hf
