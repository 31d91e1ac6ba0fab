"""Whisper (`WhisperForConditionalGeneration`): log-mel features through two 1-D
convolutions and fixed sinusoidal positions into a pre-LayerNorm encoder, a decoder
with learned positions and cross-attention, a tied head; every projection with a bias
but the keys'. The encoder's heads and feed-forward width may differ from the
decoder's (`model.audio`). `tfjax.interop.hf.load` gives a
`tfjax.models.SpeechEncoderDecoderModel` (`model(decoder_input_ids,
input_features=...)`). The encoder's sinusoids are recomputed, not read (transformers
freezes them and fills them in again when export leaves them out)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import common_fields, hf_activation, read_activation
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, attention_weights, head_weights,
                                          linear_weights, norm_weights)
from tfjax.models.speech import encoder_config

__all__ = ["FAMILY", "config", "to_hf", "weights"]


def config(hf: dict) -> dict:
    D = hf["d_model"]
    enc_heads, dec_heads = hf["encoder_attention_heads"], hf["decoder_attention_heads"]
    enc_ff, dec_ff = hf["encoder_ffn_dim"], hf["decoder_ffn_dim"]
    return dict(common_fields(hf), arch="encoder_decoder", d_model=D,
                num_layers=hf["decoder_layers"], num_encoder_layers=hf["encoder_layers"],
                num_heads=dec_heads, d_ff=dec_ff, max_len=hf["max_target_positions"],
                position="learned", norm="layernorm", norm_eps=1e-5, norm_placement="pre",
                activation=read_activation(hf, "activation_function", gated=False),
                # transformers' Whisper sets embed_scale from scale_embedding, never applies it
                ffn_bias=True, scale_embeddings=False,
                attention=dict(qkv_bias=True, k_bias=False, out_bias=True),
                # the encoder's own sizes only where they differ (one config per model)
                audio=dict(n_mels=hf["num_mel_bins"],
                           max_source_positions=hf["max_source_positions"],
                           num_heads=0 if enc_heads == dec_heads else enc_heads,
                           d_ff=0 if enc_ff == dec_ff else enc_ff))


_ATTN = ("q_proj", "k_proj", "v_proj", "out_proj")


def _ffn(w: Weights, p: str, L: tuple) -> dict:
    return {**linear_weights(w, f"{p}fc1", L + ("ffn", "wi"), True),
            **linear_weights(w, f"{p}fc2", L + ("ffn", "wo"), True)}


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["model.decoder.embed_tokens.weight"],
           ("embed", "positions", "embedding"): w["model.decoder.embed_positions.weight"]}
    out.update(head_weights(w, "proj_out.weight", cfg))
    w.ignore("model.encoder.embed_positions.weight")  # fixed sinusoids (tfjax.nn.audio)
    for conv in ("conv1", "conv2"):
        out[("audio", conv, "kernel")] = w[f"model.encoder.{conv}.weight"].transpose(2, 1, 0)
        out[("audio", conv, "bias")] = w[f"model.encoder.{conv}.bias"]
    enc = encoder_config(cfg)
    for stack, n, c in (("encoder", cfg.encoder_layers, enc), ("decoder", cfg.num_layers, cfg)):
        out.update(norm_weights(w, f"model.{stack}.layer_norm", (f"{stack}_norm",), cfg))
        for i in range(n):
            p, L = f"model.{stack}.layers.{i}.", (stack, i)
            out.update(attention_weights(w, p + "self_attn.", L + ("attn",), c, names=_ATTN))
            out.update(norm_weights(w, p + "self_attn_layer_norm", L + ("attn_norm",), cfg))
            if stack == "decoder":
                out.update(attention_weights(w, p + "encoder_attn.", L + ("cross_attn",), c,
                                             names=_ATTN))
                out.update(norm_weights(w, p + "encoder_attn_layer_norm", L + ("cross_norm",),
                                        cfg))
            out.update(_ffn(w, p, L))
            out.update(norm_weights(w, p + "final_layer_norm", L + ("ffn_norm",), cfg))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    enc = encoder_config(cfg)
    return dict(model_type="whisper", architectures=["WhisperForConditionalGeneration"],
                vocab_size=cfg.vocab_size, d_model=cfg.d_model, num_mel_bins=cfg.audio.n_mels,
                encoder_layers=cfg.encoder_layers, decoder_layers=cfg.num_layers,
                encoder_attention_heads=enc.num_heads, decoder_attention_heads=cfg.num_heads,
                encoder_ffn_dim=enc.d_ff, decoder_ffn_dim=cfg.d_ff,
                max_source_positions=cfg.audio.max_source_positions,
                max_target_positions=cfg.max_len, activation_function=hf_activation(cfg, False),
                tie_word_embeddings=cfg.tie_embeddings, is_encoder_decoder=True,
                # WhisperConfig's defaults are ids of the 51865-token vocabulary; tfjax
                # keeps no start token (generate takes decoder_input_ids) and export with
                # a tokenizer writes its bos / eos / pad
                pad_token_id=None, bos_token_id=None, eos_token_id=None,
                decoder_start_token_id=0, suppress_tokens=None, begin_suppress_tokens=None)


FAMILY = Family(model_types=("whisper",), config=config, weights=weights, to_hf=to_hf)
