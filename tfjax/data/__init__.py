"""Data: tokenizers (bytes, local tokenizer files), document sources (the stdlib
corpus, text files, jsonl) and the packed, sharded, checkpointable grain pipeline; `synthetic`: seeded synthetic
sequence tasks (MQAR, selective copying, induction heads, passkey); `objectives`: the
training objectives' host-side transforms (MLM masking, span corruption, examples)."""

from tfjax.data.pipeline import BATCH_KEYS, PackedBatches
from tfjax.data.sources import DocumentSource, documents, is_validation, stdlib_files
from tfjax.data.tokenizer import ByteTokenizer, load_tokenizer
from tfjax.data import objectives, synthetic

__all__ = [
           "BATCH_KEYS",
           "ByteTokenizer",
           "DocumentSource",
           "PackedBatches",
           "documents",
           "is_validation",
           "load_tokenizer",
           "objectives",
           "stdlib_files",
           "synthetic",
]
