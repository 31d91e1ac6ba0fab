"""The tests' tiny random Hugging Face Llama: a 2-layer d=32 `LlamaForCausalLM` over
tfjax's byte vocabulary, saved as `save_pretrained` writes it, with the byte tokenizer
beside it (for loading with `tfjax.interop.hf`, fine-tuning and post-training from it,
scoring it with transformers and lm-eval).

Test code beside the tests (tests/ is on sys.path through tests/conftest.py), as
tests/tiny_run.py is for the tiny tfjax run."""

from __future__ import annotations

import pathlib

LLAMA = dict(vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=257, eos_token_id=258)


def save_tiny_llama(path, *, seed: int = 0, weight_scale: float = 1.0, tokenizer: str | None = "json",
                    **config):
    """Write a random `LlamaForCausalLM` (torch seed `seed`; `config` overrides `LLAMA`
    field by field; matrices times `weight_scale`) to `path` and return it in eval mode.
    `tokenizer`: "json" writes the byte tokenizer's tokenizer.json, "fast" a
    `PreTrainedTokenizerFast` (tokenizer_config.json too, as lm-eval's hf backend
    reads it), None none."""
    import torch
    import transformers

    from tfjax.data import ByteTokenizer

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **config}))
    if weight_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim > 1:
                    p.mul_(weight_scale)
    model.save_pretrained(str(path))
    tok = ByteTokenizer()
    if tokenizer == "json":
        tok.hf_tokenizer().save(str(pathlib.Path(path) / "tokenizer.json"))
    elif tokenizer == "fast":
        name = tok.hf_tokenizer().id_to_token
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok.hf_tokenizer(), bos_token=name(tok.bos_id),
            eos_token=name(tok.eos_id), pad_token=name(tok.pad_id),
            model_max_length=model.config.max_position_embeddings).save_pretrained(str(path))
    elif tokenizer is not None:
        raise ValueError(f"save_tiny_llama: tokenizer={tokenizer!r}; use 'json', 'fast' or None")
    return model.eval()
