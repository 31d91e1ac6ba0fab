"""Training a byte-level BPE tokenizer with the `tokenizers` library (`train_bpe`) on a
corpus of files, globs or directories (`read_documents`: every input kind that
`python -m tfjax.data.prepare` reads, through `tfjax.data.inputs`), and saving it as a tokenizer directory (`save`: tokenizer.json + tokenizer_config.json) that
`load_tokenizer` and transformers' `AutoTokenizer` read. See docs/data.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence

from tfjax.data.inputs import read_inputs
from tfjax.data.tokenizer import _with_bos

__all__ = ["BOS", "EOS", "PAD", "read_documents", "save", "train", "train_bpe"]

PAD, BOS, EOS = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"  # ids 0, 1, 2
MIN_VOCAB = 256 + 3  # the byte alphabet and the three specials


def read_documents(inputs: Sequence[str], field: str = "text") -> Iterator[str]:
    """Each document of the files, globs and directories `inputs`, of every kind
    `tfjax.data.inputs` reads (text, jsonl / json with `field`, also gzip / zstd, parquet,
    `datasets` directories), as text (bad UTF-8 replaced)."""
    for _, text in read_inputs(inputs, field):
        yield text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


def _check(vocab_size: int, min_frequency: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"tokenizer train: --vocab_size {vocab_size} is below {MIN_VOCAB} (256 "
                         "bytes and 3 specials); raise it")
    if min_frequency < 1:
        raise ValueError(f"tokenizer train: --min_frequency {min_frequency} must be >= 1")


def train_bpe(documents, vocab_size: int, min_frequency: int = 2, length: int | None = None,
              progress: bool = True):
    """A byte-level BPE `tokenizers.Tokenizer` of at most `vocab_size` ids trained on the
    strings `documents` (`length` of them, for the progress bar): pad, bos, eos are ids
    0, 1, 2; encoding puts bos first, as `hf_tokenizer()` does."""
    _check(vocab_size, min_frequency)
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:  # pragma: no cover - depends on extras
        raise ValueError("tokenizer train needs the `tokenizers` package: pip install "
                         "'tfjax[hf]'") from e
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[PAD, BOS, EOS], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer, length=length)
    return _with_bos(tok, tok.token_to_id(BOS))


def save(tok, out: str) -> None:
    """`out`/tokenizer.json and `out`/tokenizer_config.json (its bos / eos / pad tokens,
    for transformers' `PreTrainedTokenizerFast`)."""
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=BOS, eos_token=EOS,
                  pad_token=PAD)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


@contextlib.contextmanager
def _stdout_to_stderr():
    """The `tokenizers` trainer ends its progress bars with newlines on stdout (fd 1);
    send them to stderr, where the bars are."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def train(inputs: Sequence[str], out: str, vocab_size: int, field: str = "text",
          min_frequency: int = 2, progress: bool = True) -> str:
    """Train on the documents of `inputs` and save to `out` (progress on stderr); `out`."""
    _check(vocab_size, min_frequency)
    try:
        n = sum(1 for _ in read_documents(inputs, field))  # checks every record first
    except ValueError as e:
        raise ValueError(f"tokenizer train: {e}") from None
    if n == 0:
        raise ValueError(f"tokenizer train: {', '.join(inputs)} hold no document")
    print(f"[tokenizer train: {n} documents]", file=sys.stderr, flush=True)
    with _stdout_to_stderr():
        tok = train_bpe(read_documents(inputs, field), vocab_size, min_frequency, n, progress)
    save(tok, out)
    print(f"[tokenizer train: {tok.get_vocab_size()} ids -> {out}/tokenizer.json, "
          "tokenizer_config.json]", file=sys.stderr, flush=True)
    return out
