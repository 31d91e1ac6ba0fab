"""Data: tokenizers (bytes, local tokenizer files), document sources (the stdlib
corpus, text files, jsonl) and the packed, sharded, checkpointable grain pipeline; `synthetic`: seeded synthetic
sequence tasks (MQAR, selective copying, induction heads, passkey)."""

from tfjax.data.pipeline import BATCH_KEYS, PackedBatches
from tfjax.data.sources import DocumentSource, documents, is_validation, stdlib_files
from tfjax.data.tokenizers import ByteTokenizer, load_tokenizer
from tfjax.data import synthetic

__all__ = [
           "BATCH_KEYS",
           "ByteTokenizer",
           "DocumentSource",
           "PackedBatches",
           "documents",
           "is_validation",
           "load_tokenizer",
           "stdlib_files",
           "synthetic",
]
