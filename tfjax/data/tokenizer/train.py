"""Training a byte-level BPE tokenizer with the `tokenizers` library (`train_bpe`) on a
corpus of files, globs or directories (`corpus_files`, `read_documents`: `.jsonl` /
`.json` lines, also `.gz`, give their `field`; any other file is one document), and
saving it as a tokenizer directory (`save`: tokenizer.json + tokenizer_config.json) that
`load_tokenizer` and transformers' `AutoTokenizer` read. See docs/data.md.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import sys
from collections.abc import Iterator, Sequence

from tfjax.data.tokenizer import _with_bos

__all__ = ["BOS", "EOS", "PAD", "corpus_files", "read_documents", "save", "train", "train_bpe"]

PAD, BOS, EOS = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"  # ids 0, 1, 2
JSON_LINES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
MIN_VOCAB = 256 + 3  # the byte alphabet and the three specials


def corpus_files(inputs: Sequence[str]) -> list[str]:
    """The files `inputs` name (a file, a glob, or a directory: every file under it),
    each once, sorted within an input; an input that names no file is a ValueError."""
    out: list[str] = []
    for item in inputs:
        item = os.path.expanduser(item)
        if os.path.isdir(item):
            hits = sorted(os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs)
        else:
            hits = sorted(h for h in glob.glob(item, recursive=True) if os.path.isfile(h))
        if not hits:
            raise ValueError(f"tokenizer train: {item!r} matches no file; name files, globs or "
                             "directories of text or jsonl")
        out += [h for h in hits if h not in out]
    return out


def read_documents(files: Sequence[str], field: str = "text") -> Iterator[str]:
    """Each document of `files`: a jsonl line's `field` string (blank lines skipped), or a
    whole other file's text (UTF-8, bad bytes replaced)."""
    for path in files:
        if not path.endswith(JSON_LINES):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
            continue
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"tokenizer train: {path}:{lineno}: not a JSON line ({e}); fix or drop the "
                                     "line, or rename the file if it is plain text") from None
                text = record.get(field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"tokenizer train: {path}:{lineno}: the line has no string field {field!r}; "
                                     "pass --field NAME, the field that holds the text")
                yield text


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
    files = corpus_files(inputs)
    n = sum(1 for _ in read_documents(files, field))  # checks every line before training
    if n == 0:
        raise ValueError(f"tokenizer train: {', '.join(inputs)} hold no document")
    print(f"[tokenizer train: {n} documents in {len(files)} files]", file=sys.stderr, flush=True)
    with _stdout_to_stderr():
        tok = train_bpe(read_documents(files, field), vocab_size, min_frequency, n, progress)
    save(tok, out)
    print(f"[tokenizer train: {tok.get_vocab_size()} ids -> {out}/tokenizer.json, "
          "tokenizer_config.json]", file=sys.stderr, flush=True)
    return out
