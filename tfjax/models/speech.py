"""Speech-to-text encoder-decoder (Whisper, Radford et al. 2022).

    logits  = model(decoder_input_ids, input_features=features)   # [B, T, V]
    encoded = model.encode(features)                              # [B, ceil(F/2), D]
    tokens  = generate(model, features, decoder_input_ids, max_new_tokens=N)

`EncoderDecoderModel` with `model.audio`: the encoder reads log-mel features
`[B, n_mels, F]` through `tfjax.nn.audio.AudioFrontEnd`, with `audio.num_heads` /
`audio.d_ff` where set; decoder, caches and head are the encoder-decoder's. Bad
features: one line naming `input_features`, before anything compiles. See
docs/multimodal.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.models.attention_inputs import layer_biases, layer_masks
from tfjax.models.encoder_decoder import EncoderDecoderModel
from tfjax.models.stack import default_positions, dtype_of
from tfjax.nn.audio import AudioFrontEnd
from tfjax.nn.hooks import scope
from tfjax.nn.norms import hooked_norm

__all__ = ["SpeechEncoderDecoderModel", "check_features", "encoder_config", "generate"]


def encoder_config(cfg: ModelConfig) -> ModelConfig:
    """The encoder blocks' config: `model.audio.num_heads` heads of d_model / heads
    (multi-head) and `audio.d_ff`, where set; the rest the model's."""
    a = cfg.audio
    c = cfg
    if a.num_heads:
        c = dataclasses.replace(c, num_heads=a.num_heads, num_kv_heads=0, head_dim=0,
                                v_head_dim=0)
    if a.d_ff:
        c = dataclasses.replace(c, d_ff=a.d_ff)
    return c


def check_features(cfg: ModelConfig, input_features) -> None:
    """A one-line ValueError naming `input_features` unless it is a floating array
    `[B, audio.n_mels, F]` with 1 <= F <= 2 * audio.max_source_positions."""
    a = cfg.audio
    want = (f"log-mel features [batch, n_mels={a.n_mels}, frames <= {a.max_frames}] "
            f"(floating point)")
    shape = getattr(input_features, "shape", None)
    dtype = getattr(input_features, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"input_features: expected an array of {want}, got "
                         f"{type(input_features).__name__}")
    if len(shape) != 3:
        raise ValueError(f"input_features: expected rank 3, {want}; got shape {tuple(shape)}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"input_features: expected {want}; got dtype {dtype} (cast the "
                         f"features, not token ids, to float32)")
    if shape[1] != a.n_mels:
        raise ValueError(f"input_features: {shape[1]} mel bins, the model takes "
                         f"model.audio.n_mels={a.n_mels} (shape [batch, n_mels, frames]; got "
                         f"{tuple(shape)}: a feature extractor of feature_size={a.n_mels})")
    if not 1 <= shape[2] <= a.max_frames:
        raise ValueError(f"input_features: {shape[2]} frames; the encoder's "
                         f"{a.max_source_positions} positions take 1 to {a.max_frames} "
                         f"(audio too long: split it into chunks of at most {a.max_frames})")


class SpeechEncoderDecoderModel(EncoderDecoderModel):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not cfg.audio.n_mels:
            raise ValueError("SpeechEncoderDecoderModel: set model.audio.n_mels (the log-mel "
                             "bins of its input features)")
        self.encoder_config = encoder_config(cfg)
        super().__init__(cfg, rngs=rngs, encoder_config=self.encoder_config)
        self.audio = AudioFrontEnd(cfg.audio.n_mels, cfg.d_model, dtype=dtype_of(cfg.dtype),
                                   param_dtype=dtype_of(cfg.param_dtype),
                                   init_std=cfg.init_std, rngs=rngs)

    def encode(self, input_features):
        """features `[B, n_mels, F]` -> encoder output `[B, ceil(F / 2), D]`."""
        check_features(self.config, input_features)
        with scope("encoder"):  # hook names "encoder.*" (tfjax.nn.hooks)
            x = self.audio(input_features)
            positions = default_positions(x[..., 0])
            c = self.encoder_config
            x = self.encoder(x, masks=layer_masks(c, None, bidirectional=True),
                             biases=layer_biases(c, None, positions, positions),
                             positions=positions)
            return x if self.encoder_norm is None else hooked_norm("ln_final",
                                                                    self.encoder_norm, x)

    def __call__(self, decoder_input_ids, input_features=None, decoder_segment_ids=None,
                 decoder_positions=None):
        if input_features is None:
            raise ValueError("input_features: a speech model needs its log-mel features, "
                             "model(decoder_input_ids, input_features=...)")
        return self.decode(decoder_input_ids, self.encode(input_features), None,
                           decoder_segment_ids, decoder_positions)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _greedy(graphdef, state, features, prompt, *, max_new_tokens):
    model = nnx.merge(graphdef, state)
    B, T = prompt.shape
    encoded = model.encode(features)
    cache = model.init_cache(B, T + max_new_tokens, encoder_len=encoded.shape[1])
    logits, cache = model.step(prompt, cache, encoded)  # cross K/V computed here, once
    first = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)

    def scan(carry, _):  # the parameters ride in the carry (an nnx module is no jax value)
        state, cache, tok = carry
        logits, cache = nnx.merge(graphdef, state).step(tok[:, None], cache)
        nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return (state, cache, nxt), tok

    (_, _, last), toks = jax.lax.scan(scan, (state, cache, first), None,
                                      length=max_new_tokens - 1)
    return jnp.concatenate([toks.T, last[:, None]], axis=1)


def generate(model: SpeechEncoderDecoderModel, input_features, decoder_input_ids, *,
             max_new_tokens: int, eos_id: int | None = None, pad_id: int | None = None):
    """Greedy tokens `[B, max_new_tokens]` after the decoder prompt `decoder_input_ids`
    `[B, T]` (Whisper's forced start tokens, the same length in every row): the
    encoder runs once, its cross-attention K/V are cached at the first step. Rows
    that emitted `eos_id` continue with `pad_id` (default `eos_id`)."""
    check_features(model.config, input_features)
    prompt = jnp.asarray(decoder_input_ids, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[0] != input_features.shape[0] or not prompt.shape[1]:
        raise ValueError(f"decoder_input_ids: expected [batch={input_features.shape[0]}, T >= 1] "
                         f"start tokens, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    cfg = model.config
    if cfg.position == "learned" and prompt.shape[1] + max_new_tokens > cfg.max_len:
        raise ValueError(f"max_new_tokens: decoder prompt + generated = "
                         f"{prompt.shape[1] + max_new_tokens} tokens exceed model.max_len="
                         f"{cfg.max_len} (Whisper: max_target_positions)")
    graphdef, state = nnx.split(model)
    out = np.asarray(_greedy(graphdef, state, jnp.asarray(input_features), prompt,
                             max_new_tokens=int(max_new_tokens)))
    if eos_id is not None:  # everything after a row's first eos is padding
        after = np.cumsum(out == eos_id, axis=1) - (out == eos_id) > 0
        out = np.where(after, eos_id if pad_id is None else pad_id, out)
    return jnp.asarray(out)
