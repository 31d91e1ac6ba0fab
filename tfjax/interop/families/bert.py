"""BERT (`BertForMaskedLM`, `BertForPreTraining`; `BertModel` without its `bert.`
prefix): post-norm LayerNorms, learned positions and token types, an embedding norm,
exact GELU, and the MLM head (dense, norm, the decoder tied to the embedding and its
bias); the pooler loads when the checkpoint has it, the NSP head (which tfjax lacks)
is left out. `tfjax.interop.hf.load` gives an `HFEncoder`."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import common_fields, require, unsupported
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, attention_weights, head_weights,
                                          linear_weights, norm_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]


def config(hf: dict) -> dict:
    require(hf, "position_embedding_type", ("absolute",))
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        unsupported("is_decoder", True, "BERT as an encoder only")
    if hf.get("hidden_act", "gelu") != "gelu":  # our MLM head uses exact GELU
        unsupported("hidden_act", hf["hidden_act"], "supported: 'gelu'")
    return dict(common_fields(hf), arch="encoder", d_model=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                d_ff=hf["intermediate_size"], max_len=hf["max_position_embeddings"],
                position="learned", type_vocab_size=hf.get("type_vocab_size", 2), num_classes=0,
                norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
                final_norm=False, embed_norm=True, activation="gelu", ffn_bias=True,
                attention=dict(qkv_bias=True, out_bias=True))


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    e = "bert.embeddings."
    out = {("embed", "tokens", "embedding"): w[e + "word_embeddings.weight"],
           ("embed", "positions", "embedding"): w[e + "position_embeddings.weight"],
           ("embed", "token_types", "embedding"): w[e + "token_type_embeddings.weight"],
           **norm_weights(w, e + "LayerNorm", ("embed", "norm"), cfg)}
    w.ignore(e + "position_ids", e + "token_type_ids")
    for i in range(cfg.num_layers):
        p, L = f"bert.encoder.layer.{i}.", ("layers", i)
        out.update(attention_weights(w, p + "attention.self.", L + ("attn",), cfg,
                                     names=("query", "key", "value",
                                            f"/{p}attention.output.dense")))
        out.update(norm_weights(w, p + "attention.output.LayerNorm", L + ("attn_norm",), cfg))
        out.update(linear_weights(w, p + "intermediate.dense", L + ("ffn", "wi"), True))
        out.update(linear_weights(w, p + "output.dense", L + ("ffn", "wo"), True))
        out.update(norm_weights(w, p + "output.LayerNorm", L + ("ffn_norm",), cfg))
    c = "cls.predictions."
    out.update(linear_weights(w, c + "transform.dense", ("mlm_dense",), True))
    out.update(norm_weights(w, c + "transform.LayerNorm", ("mlm_norm",), cfg))
    out[("mlm_bias",)] = w[c + "bias"]
    out.update(head_weights(w, c + "decoder.weight", cfg))
    w.ignore(c + "decoder.bias")  # the MLM bias is `mlm_bias` (cls.predictions.bias), tied to it
    if "bert.pooler.dense.weight" in w:
        out.update(linear_weights(w, "bert.pooler.dense", ("pooler",), True))
    w.ignore("cls.seq_relationship.weight", "cls.seq_relationship.bias")  # NSP head
    return out


def to_hf(cfg: ModelConfig) -> dict:
    """BERT with its MLM head (`tfjax.interop.hf.export` names BertForPreTraining
    instead for a loaded checkpoint that has the pooler)."""
    return dict(model_type="bert", architectures=["BertForMaskedLM"], vocab_size=cfg.vocab_size,
                hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff,
                max_position_embeddings=cfg.max_len, type_vocab_size=cfg.type_vocab_size,
                layer_norm_eps=cfg.norm_eps, hidden_act="gelu", position_embedding_type="absolute",
                tie_word_embeddings=cfg.tie_embeddings)


FAMILY = Family(model_types=("bert",), config=config, weights=weights, to_hf=to_hf,
                prefix="bert.")
