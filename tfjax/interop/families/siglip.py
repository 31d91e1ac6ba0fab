"""SigLIP's vision tower (`SiglipVisionModel`, model_type "siglip_vision_model"; the
vision half of a `SiglipModel`, "siglip", whose text tower and logit scale / bias
are read and left out): patches, learned positions, pre-LN blocks with biased
attention and MLPs, the post-LayerNorm and, with `vision_use_head`, the attention
pooling head. Loads as a `tfjax.models.VisionEncoder` (`model(pixel_values)` is
`last_hidden_state`, `model.pool(...)` `pooler_output`); export writes
`SiglipVisionModel`. `tower_config` / `tower_weights` serve the towers of
vision-language families (PaliGemma). See docs/multimodal.md.
"""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import unsupported
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, attention_weights, heads_in, heads_out,
                                          linear_weights, norm_weights)

__all__ = ["ACTIVATIONS", "FAMILY", "activation", "config", "to_hf", "to_hf_vision",
           "tower_weights", "vision_fields", "weights"]

# HF hidden_act -> model.activation (the MLPs of the blocks and of the head)
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu",
               "relu": "relu", "silu": "silu"}


def _vision_config(hf: dict) -> dict:
    return hf["vision_config"] if hf.get("model_type") == "siglip" else hf


def vision_fields(v: dict) -> dict:
    """The `model.vision` image fields of a SigLIP vision config dict."""
    for key in ("image_size", "patch_size"):
        if not isinstance(v.get(key, 0), int):
            unsupported(key, v[key], "a single int (square images and patches, as "
                        "SiglipVisionEmbeddings computes num_patches)")
    return dict(image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 16),
                channels=v.get("num_channels", 3))


def activation(v: dict) -> str:
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        unsupported("hidden_act", act, f"supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def config(hf: dict) -> dict:
    v = _vision_config(hf)
    return dict(arch="vision", d_model=v.get("hidden_size", 768),
                num_layers=v.get("num_hidden_layers", 12),
                num_heads=v.get("num_attention_heads", 12), d_ff=v.get("intermediate_size", 3072),
                activation=activation(v), ffn_bias=True, position="learned", norm="layernorm",
                norm_bias=True, norm_eps=v.get("layer_norm_eps", 1e-6), norm_placement="pre",
                final_norm=True, attention=dict(qkv_bias=True, out_bias=True),
                dropout_rate=0.0, scan_layers=True,
                vision=dict(vision_fields(v),
                            pooling="map" if v.get("vision_use_head", True) else "none"))


def tower_weights(w: Weights, cfg: ModelConfig, p: str = "vision_model.",
                  at: tuple = ()) -> dict:
    """The tower's tensors under `p` as a `VisionEncoder` at `at` (its parameters' path
    prefix) holds them; `cfg`: the tower's config (`tfjax.models.vision.tower_config`)."""
    e = p + "embeddings."
    weight = w[e + "patch_embedding.weight"]  # a Conv2d's [D, C, p, p] -> our [p, p, C, D]
    out = {at + ("patches", "kernel"): weight.transpose(2, 3, 1, 0),
           at + ("patches", "bias"): w[e + "patch_embedding.bias"],
           at + ("positions", "embedding"): w[e + "position_embedding.weight"]}
    w.ignore(e + "position_ids")
    for i in range(cfg.num_layers):
        q, L = f"{p}encoder.layers.{i}.", at + ("layers", i)
        out.update(attention_weights(w, q + "self_attn.", L + ("attn",), cfg,
                                     names=("q_proj", "k_proj", "v_proj", "out_proj")))
        out.update(norm_weights(w, q + "layer_norm1", L + ("attn_norm",), cfg))
        out.update(norm_weights(w, q + "layer_norm2", L + ("ffn_norm",), cfg))
        out.update(linear_weights(w, q + "mlp.fc1", L + ("ffn", "wi"), True))
        out.update(linear_weights(w, q + "mlp.fc2", L + ("ffn", "wo"), True))
    out.update(norm_weights(w, p + "post_layernorm", at + ("final_norm",), cfg))
    if cfg.vision.pooling == "map":
        out.update(_head_weights(w, p + "head.", at + ("head",), cfg))
    return out


def _head_weights(w: Weights, p: str, H: tuple, cfg: ModelConfig) -> dict:
    """The MAP head: its probe, torch's `nn.MultiheadAttention` (q, k, v stacked in
    `in_proj_weight` `[3D, D]`), its LayerNorm and MLP."""
    N, Hd, D = cfg.num_heads, cfg.head_size, cfg.d_model
    qkv, b = w[p + "attention.in_proj_weight"], w[p + "attention.in_proj_bias"]
    out = {H + ("probe",): w[p + "probe"]}
    for j, name in enumerate("qkv"):
        out[H + ("attn", name, "kernel")] = heads_in(qkv[j * D:(j + 1) * D], N, Hd)
        out[H + ("attn", name, "bias")] = b[j * D:(j + 1) * D].reshape(N, Hd)
    out[H + ("attn", "o", "kernel")] = heads_out(w[p + "attention.out_proj.weight"], N, Hd)
    out[H + ("attn", "o", "bias")] = w[p + "attention.out_proj.bias"]
    out.update(norm_weights(w, p + "layernorm", H + ("norm",), cfg))
    out.update(linear_weights(w, p + "mlp.fc1", H + ("ffn", "wi"), True))
    out.update(linear_weights(w, p + "mlp.fc2", H + ("ffn", "wo"), True))
    return out


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = tower_weights(w, cfg)
    if hf.get("model_type") == "siglip":  # the text tower and the contrastive scale: not ours
        w.ignore(*[n for n in w.ckpt if n.startswith("text_model.")], "logit_scale",
                 "logit_bias")
    return out


def to_hf_vision(cfg: ModelConfig) -> dict:
    """The vision config dict of the tower of `cfg` (its own config, arch="vision")."""
    names = {ours: theirs for theirs, ours in reversed(ACTIVATIONS.items())}
    v = cfg.vision
    if v.width != v.image_size:
        unsupported("image_width", v.width, "SigLIP's images are square")
    return dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_channels=v.channels, image_size=v.image_size, patch_size=v.patch_size,
                hidden_act=names.get(cfg.activation, cfg.activation),
                layer_norm_eps=cfg.norm_eps, attention_dropout=0.0,
                vision_use_head=v.pooling == "map")


def to_hf(cfg: ModelConfig) -> dict:
    return dict(model_type="siglip_vision_model", architectures=["SiglipVisionModel"],
                **to_hf_vision(cfg))


FAMILY = Family(model_types=("siglip_vision_model", "siglip"), config=config, weights=weights,
                to_hf=to_hf, prefix="vision_model.")
