"""T5 (`T5ForConditionalGeneration`): an encoder-decoder with T5's bucketed relative
position bias (one table per stack, in layer 0), RMSNorm, no biases, an unscaled softmax
(`model.attention.scale=1`), a plain or gated MLP (`feed_forward_proj`,
`dense_act_fn`), and with a tied head the decoder output scaled by d_model ** -0.5
(`scale_decoder_outputs`). `tfjax.interop.hf.load` gives an `EncoderDecoderModel`."""

from __future__ import annotations

import math

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import PLAIN, common_fields, hf_activation, read_activation
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, attention_weights, head_weights,
                                          linear_weights, norm_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]


def config(hf: dict) -> dict:
    proj = hf.get("feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = hf.get("dense_act_fn") or proj.split("-")[-1]
    activation = read_activation({"act": act}, "act", gated=gated)
    D = hf["d_model"]
    scale_out = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return dict(common_fields(hf), arch="encoder_decoder", d_model=D,
                num_layers=hf.get("num_decoder_layers") or hf["num_layers"],
                num_encoder_layers=hf["num_layers"], num_heads=hf["num_heads"],
                head_dim=hf["d_kv"], d_ff=hf["d_ff"], max_len=512, position="t5",
                t5=dict(num_buckets=hf.get("relative_attention_num_buckets", 32),
                        max_distance=hf.get("relative_attention_max_distance", 128)),
                norm="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-6), norm_placement="pre",
                activation=activation, ffn_bias=False,
                attention=dict(qkv_bias=False, out_bias=False, scale=1.0),
                logits_scale=D ** -0.5 if scale_out else 1.0)


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["shared.weight"]}
    w.ignore("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    out.update(head_weights(w, "lm_head.weight", cfg))
    qkvo = ("q", "k", "v", "o")

    def ffn(p, L):
        if cfg.activation in ("relu", "gelu", "gelu_tanh", "silu"):
            pairs = (("wi", "wi"), ("wo", "wo"))
        else:
            pairs = (("wi_gate", "wi_0"), ("wi_up", "wi_1"), ("wo", "wo"))
        return {k: v for ours, theirs in pairs for k, v in linear_weights(
            w, f"{p}.DenseReluDense.{theirs}", L + ("ffn", ours), False).items()}

    for stack, n in (("encoder", cfg.encoder_layers), ("decoder", cfg.num_layers)):
        out[(f"{stack}_rel_bias", "embedding")] = w[
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        out.update(norm_weights(w, f"{stack}.final_layer_norm", (f"{stack}_norm",), cfg))
        for i in range(n):
            p, L = f"{stack}.block.{i}.layer.", (stack, i)
            out.update(attention_weights(w, p + "0.SelfAttention.", L + ("attn",), cfg,
                                         names=qkvo))
            out.update(norm_weights(w, p + "0.layer_norm", L + ("attn_norm",), cfg))
            f = 1
            if stack == "decoder":
                out.update(attention_weights(w, p + "1.EncDecAttention.", L + ("cross_attn",),
                                             cfg, names=qkvo))
                out.update(norm_weights(w, p + "1.layer_norm", L + ("cross_norm",), cfg))
                f = 2
            out.update(ffn(f"{p}{f}", L))
            out.update(norm_weights(w, f"{p}{f}.layer_norm", L + ("ffn_norm",), cfg))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    gated = cfg.activation not in PLAIN.values()
    act = hf_activation(cfg, gated)
    # HF's feed_forward_proj names gelu "gelu" and takes the exact form from dense_act_fn
    proj = ("gated-" if gated else "") + {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
                                          "swish": "silu"}.get(act, act)
    return dict(model_type="t5", architectures=["T5ForConditionalGeneration"],
                vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.head_size, d_ff=cfg.d_ff,
                num_layers=cfg.encoder_layers, num_decoder_layers=cfg.num_layers,
                num_heads=cfg.num_heads, relative_attention_num_buckets=cfg.t5.num_buckets,
                relative_attention_max_distance=cfg.t5.max_distance,
                layer_norm_epsilon=cfg.norm_eps, feed_forward_proj=proj, dense_act_fn=act,
                tie_word_embeddings=cfg.tie_embeddings,
                scale_decoder_outputs=not math.isclose(cfg.logits_multiplier, 1.0),
                is_encoder_decoder=True)


FAMILY = Family(model_types=("t5",), config=config, weights=weights, to_hf=to_hf)
