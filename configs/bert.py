"""BERT (Devlin et al. 2019): encoder-only, learned positions, token types,
post-LayerNorm (eps 1e-12) with a LayerNorm on the embeddings, exact GELU, MLM
head tied to the embeddings, [CLS] pooler and a classification head.
Default: BERT-base (110M) with a 2-way classifier.

    model = tfjax.models.build(get_config("tiny").model)
    mlm_logits = model(tokens, token_type_ids, attention_mask)
    class_logits = model.classify(tokens, token_type_ids, attention_mask)

Trains with BERT's masked-language-model objective (`train.objective="mlm"`: 15 %
of the real tokens selected, 80/10/10; `train.whole_word_mask=True` for whole
words) on packed documents, the stdlib corpus by default:

    python -m tfjax.train --config configs/bert.py:tiny --workdir /tmp/bert

(300 steps of 16 x 128 tokens: about 70 s on a busy 2-core CPU, then val_loss 3.21
nats per masked token, val_accuracy 0.224 on the selected tokens; 5.5 at the start)

and fine-tunes a classifier on a jsonl of `text` / `label` with
`--config.train.objective=classification --config.data.source=jsonl
--config.data.paths="('train.jsonl',)"` (val_accuracy at the end). The mask token
is id 259 (the byte tokenizer's 259 ids + 1), so "tiny" keeps vocab_size 512.
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="encoder", vocab_size=30522, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
        max_len=512, position="learned", type_vocab_size=2, num_classes=2, norm="layernorm",
        norm_eps=1e-12, norm_placement="post", final_norm=False, embed_norm=True,
        activation="gelu", ffn_bias=True, tie_embeddings=True,
        dropout_rate=0.1, attention=dict(qkv_bias=True, out_bias=True)))
    cfg.train.objective = "mlm"
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=256,
                               max_len=128, dropout_rate=0.0),
                 "train": dict(seq_len=128, batch_size=16, steps=300, warmup_steps=30)},
        "large": {"model": dict(d_model=1024, num_layers=24, num_heads=16, d_ff=4096)},
    })
