"""Gemma 3 with images (`Gemma3ForConditionalGeneration`, model_type "gemma3"): a SigLIP
vision tower without its head (`siglip.tower_weights`), Gemma 3's projector (the patch
grid average-pooled to `mm_tokens_per_image`, an RMSNorm (1 + w), a linear map) and the
Gemma 3 decoder (`gemma3_text`, Llama's tensors under `language_model.`), loaded as a
`tfjax.models.ImagePrefixLM` with `model.vision.image_attention="blocks"`: each
image's tokens see each other both ways, the rest is causal. See docs/multimodal.md.
"""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import unsupported
from tfjax.interop.families import Family, gemma3_text, llama, paligemma, siglip
from tfjax.interop.tensor_mapping import Weights
from tfjax.models.vision import tower_config

__all__ = ["FAMILY", "config", "to_hf", "weights"]

_PROJECTOR = "multi_modal_projector."


def config(hf: dict) -> dict:
    text, v = dict(hf["text_config"]), dict(hf["vision_config"])
    if v.get("vision_use_head"):
        unsupported("vision_config.vision_use_head", True, "Gemma 3's tower has no head")
    if text.pop("use_bidirectional_attention", False):
        unsupported("text_config.use_bidirectional_attention", True,
                    "Gemma 3's image blocks are given by the image tokens")
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    c = gemma3_text.config(text)
    c.update(vision=dict(
        siglip.vision_fields(v), pooling="none", image_token_id=hf["image_token_index"],
        projector="pooled", tokens_per_image=hf.get("mm_tokens_per_image", 256),
        image_attention="blocks", d_model=v.get("hidden_size", 768),
        num_layers=v.get("num_hidden_layers", 12), num_heads=v.get("num_attention_heads", 12),
        d_ff=v.get("intermediate_size", 3072), activation=siglip.activation(v),
        norm_eps=v.get("layer_norm_eps", 1e-6)))
    return c


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = llama.weights(paligemma.Text(w), cfg, hf["text_config"])
    out.update(siglip.tower_weights(w, tower_config(cfg), p="vision_tower.", at=("vision",)))
    out[("projector", "linear", "kernel")] = w[_PROJECTOR + "mm_input_projection_weight"]
    out[("projector", "norm", "scale")] = w[_PROJECTOR + "mm_soft_emb_norm.weight"]
    return out


def to_hf(cfg: ModelConfig) -> dict:
    v = cfg.vision
    if not v.image_size or cfg.arch != "decoder" or v.projector != "pooled" \
            or v.image_attention != "blocks":
        unsupported("model.vision", v, "Gemma 3 is a decoder with images, "
                    "projector='pooled' and image_attention='blocks'")
    text = gemma3_text.to_hf(cfg)
    text.pop("architectures", None)
    vision = dict(model_type="siglip_vision_model", **siglip.to_hf_vision(tower_config(cfg)))
    return dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                text_config=text, vision_config=vision, image_token_index=v.image_token_id,
                mm_tokens_per_image=v.tokens_per_image, tie_word_embeddings=cfg.tie_embeddings)


FAMILY = Family(model_types=("gemma3",), config=config, weights=weights, to_hf=to_hf)
