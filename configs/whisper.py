"""Whisper (Radford et al. 2022): log-mel features through two 1-D convolutions and
fixed sinusoidal positions into a pre-LayerNorm encoder; a decoder with learned
positions, cross-attention and a tied head; biases everywhere but the key
projections; GELU. Default: whisper-tiny's sizes (4 + 4 layers, d_model 384, 30 s
windows). Trains speech to text (`train.objective="speech_to_text"`) on the shipped
spoken digits (`data.source="synthetic"`, byte tokens):

    python -m tfjax.train --config configs/whisper.py:tiny --workdir /tmp/whisper

("tiny": 2 + 2 layers of d_model 64, 2 s windows of 80 mel bins, 16 utterances a
batch, 800 steps: about 10 min on the loaded 2-core CPU, the loss 5.6 -> 0.02, val_loss
0.015 nats per token, 98 % of held-out digits transcribed right by greedy decoding;
experiments/results/multimodal_training.md, "Audio"), or on your own
audio with `--config.data.source=jsonl --config.data.paths="('train.jsonl',)"`, each
line {"audio": "clip.wav", "text": ...} (16 kHz 16-bit WAV, a path relative to the
file; parquet: the WAV bytes), within `model.audio.max_source_positions` / 50 s.
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="encoder_decoder", vocab_size=51865, d_model=384, num_layers=4, num_heads=6,
        d_ff=1536, max_len=448, position="learned", norm="layernorm", norm_eps=1e-5,
        norm_placement="pre", activation="gelu", ffn_bias=True, scale_embeddings=False,
        tie_embeddings=True, attention=dict(qkv_bias=True, k_bias=False, out_bias=True),
        audio=dict(n_mels=80, max_source_positions=1500)))
    cfg.train.objective = "speech_to_text"
    cfg.train.update(dict(seq_len=64, sample_tokens=0))
    cfg.data.source = "synthetic"
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=259, d_model=64, num_layers=2, num_heads=4, d_ff=256,
                               max_len=32, audio=dict(max_source_positions=100)),
                 "train": dict(seq_len=32, batch_size=16, steps=800, warmup_steps=40, lr=3e-3,
                               eval_every=200, eval_batches=4, log_every=20)},
    })
