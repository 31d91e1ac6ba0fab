"""PaliGemma 2 (`PaliGemmaForConditionalGeneration` over a Gemma 2 text config): a
SigLIP vision tower without its head (`siglip.tower_weights`), a linear projector
and the Gemma 2 decoder (`gemma2`, Llama's tensors under `language_model.`), loaded
as a `tfjax.models.ImagePrefixLM`: the image tokens' embeddings are the projected
patch features and the type-0 tokens (image and prompt) the bidirectional prefix.
PaliGemma 1's Gemma text config is refused by name. See docs/multimodal.md.
"""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import unsupported
from tfjax.interop.families import Family, gemma2, siglip
from tfjax.interop.tensor_mapping import Weights, linear_weights
from tfjax.models.vision import tower_config

__all__ = ["FAMILY", "Text", "config", "to_hf", "weights"]

_TEXT = "language_model."  # where PaliGemma saves the Gemma decoder's own tensor names


class Text:
    """The checkpoint as a text family's mapping reads it: its names under `_TEXT`
    (PaliGemma's and Gemma 3's decoder)."""

    def __init__(self, w: Weights):
        self.w = w

    def __getitem__(self, name: str):
        return self.w[_TEXT + name]

    def __contains__(self, name: str) -> bool:
        return _TEXT + name in self.w

    def ignore(self, *names: str) -> None:
        self.w.ignore(*[_TEXT + n for n in names])


def config(hf: dict) -> dict:
    text, v = dict(hf["text_config"]), dict(hf["vision_config"])
    if text.get("model_type") != "gemma2":
        unsupported("text_config.model_type", text.get("model_type"),
                    "PaliGemma 2 (a gemma2 decoder) only")
    if v.get("vision_use_head"):
        unsupported("vision_config.vision_use_head", True, "PaliGemma's tower has no head")
    if hf.get("projection_dim", text["hidden_size"]) != text["hidden_size"]:
        unsupported("projection_dim", hf["projection_dim"], "must be text_config.hidden_size")
    text.pop("use_bidirectional_attention", None)  # the prefix mask is given by token types
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    c = gemma2.config(text)
    c.update(prefix_lm=True, vision=dict(
        siglip.vision_fields(v), pooling="none", image_token_id=hf["image_token_index"],
        d_model=v.get("hidden_size", 768), num_layers=v.get("num_hidden_layers", 12),
        num_heads=v.get("num_attention_heads", 12), d_ff=v.get("intermediate_size", 3072),
        activation=siglip.activation(v), norm_eps=v.get("layer_norm_eps", 1e-6)))
    return c


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = gemma2.FAMILY.weights(Text(w), cfg, hf["text_config"])
    out.update(siglip.tower_weights(w, tower_config(cfg), p="vision_tower.", at=("vision",)))
    out.update(linear_weights(w, "multi_modal_projector.linear", ("projector",), True))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    if not cfg.vision.image_size or cfg.arch != "decoder":
        unsupported("model.vision.image_size", cfg.vision.image_size,
                    "PaliGemma is a decoder with images")
    if cfg.vision.projector != "linear" or cfg.vision.image_attention != "prefix":
        unsupported("model.vision", (cfg.vision.projector, cfg.vision.image_attention),
                    "PaliGemma's projector is 'linear' and its image_attention 'prefix'")
    text = gemma2.to_hf(cfg)
    text.pop("architectures", None)
    vision = dict(model_type="siglip_vision_model", **siglip.to_hf_vision(tower_config(cfg)))
    return dict(model_type="paligemma", architectures=["PaliGemmaForConditionalGeneration"],
                text_config=text, vision_config=vision,
                image_token_index=cfg.vision.image_token_id, projection_dim=cfg.d_model,
                hidden_size=cfg.d_model, vocab_size=cfg.vocab_size,
                tie_word_embeddings=cfg.tie_embeddings)


FAMILY = Family(model_types=("paligemma",), config=config, weights=weights, to_hf=to_hf)
