"""What the evaluation tests score: a random tiny Hugging Face Llama with a byte-level
tokenizer (tfjax's `ByteTokenizer` as tokenizer.json), saved as `save_pretrained`
writes it (scored with tfjax and with transformers / lm-eval's `hf` backend). The
tfjax training run directory is tests/tiny_run.py's `saved_run`."""

from __future__ import annotations

CONTEXT = 32  # max_position_embeddings: the tests' texts are longer, to make windows


def save_tiny_llama(path: str):
    """Write the checkpoint and its tokenizer to `path`; return the transformers model."""
    import torch
    import transformers

    from tfjax.data import ByteTokenizer

    tok = ByteTokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    hf_tok = tok.hf_tokenizer()
    name = hf_tok.id_to_token
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf_tok, bos_token=name(tok.bos_id), eos_token=name(tok.eos_id),
        pad_token=name(tok.pad_id), model_max_length=CONTEXT).save_pretrained(path)
    return model
