"""BERT (Devlin et al. 2019): encoder-only, learned positions, token types,
post-LayerNorm (eps 1e-12) with a LayerNorm on the embeddings, exact GELU, MLM
head tied to the embeddings, [CLS] pooler and a classification head.
Default: BERT-base (110M) with a 2-way classifier.

    model = tfjax.models.build(get_config("tiny").model)
    mlm_logits = model(tokens, token_type_ids, attention_mask)
    class_logits = model.classify(tokens, token_type_ids, attention_mask)

`python -m tfjax.train` trains decoder LMs; encoders are built and used as above.
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="encoder", vocab_size=30522, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
        max_len=512, position="learned", type_vocab_size=2, num_classes=2, norm="layernorm",
        norm_eps=1e-12, norm_placement="post", final_norm=False, embed_norm=True,
        activation="gelu", ffn_bias=True, qkv_bias=True, out_bias=True, tie_embeddings=True,
        dropout_rate=0.1))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=256,
                               max_len=128, dropout_rate=0.0)},
        "large": {"model": dict(d_model=1024, num_layers=24, num_heads=16, d_ff=4096)},
    })
