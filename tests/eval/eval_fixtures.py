"""What the evaluation tests score: tests/tiny_hf.py's tiny random Llama over the byte
vocabulary with a `PreTrainedTokenizerFast` (scored with tfjax and with transformers /
lm-eval's `hf` backend), its context `CONTEXT` positions. The tfjax training run
directory is tests/tiny_run.py's `saved_run`."""

from __future__ import annotations

from tiny_hf import save_tiny_llama as _save

CONTEXT = 32  # max_position_embeddings: the tests' texts are longer, to make windows


def save_tiny_llama(path: str):
    """Write the checkpoint and its tokenizer to `path`; return the transformers model."""
    from tfjax.data import ByteTokenizer

    tok = ByteTokenizer()
    return _save(path, tokenizer="fast", vocab_size=tok.vocab_size,
                 max_position_embeddings=CONTEXT, initializer_range=0.2, pad_token_id=tok.pad_id)
