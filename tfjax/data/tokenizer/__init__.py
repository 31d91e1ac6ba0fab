"""Tokenizers: bytes (no download, the default), `tokenizers` JSON files, sentencepiece
models, and directories holding one (`load_tokenizer`). Each gives `encode(text) -> int32
ids`, `decode(ids) -> str`, `pad_id` / `bos_id` / `eos_id` (for a JSON file: declared by
the files beside it, `specials`), `vocab_size`, `token_bytes` (UTF-8 bytes per id, 0 for
specials: bits per byte for any tokenizer), `fingerprint` (sha256 of what fixes the ids
and specials) and `hf_tokenizer()` (a `tokenizers.Tokenizer` whose `encode(text).ids` is
`[bos_id] + encode(text)`). `python -m tfjax.data.tokenizer train` trains a byte-level
BPE (`train`). See docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

from tfjax import storage
from tfjax.data.tokenizer.specials import DECLARING_FILES, declared_specials

__all__ = ["TOKENIZER_FILES", "ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer",
           "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes 0..255 are their own ids; specials follow: pad 256, bos 257, eos 258."""

    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 259
    name = "byte"
    fingerprint = hashlib.sha256(b"tfjax byte tokenizer: 256 bytes, pad 256, bos 257, eos 258"
                                 ).hexdigest()

    def __init__(self):
        self.token_bytes = np.array([1] * 256 + [0] * 3, np.int32)

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def hf_tokenizer(self):
        """This tokenizer in `tokenizers` form: GPT-2's byte-level alphabet with no merges,
        so byte b is id b; specials `<|pad|>`, `<|begin_of_text|>`, `<|end_of_text|>` are
        256, 257, 258 (as added tokens, so that text spelling one of them encodes to its
        id); decoding replaces invalid UTF-8 as `decode` does."""
        try:
            from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        except ImportError as e:  # pragma: no cover - depends on extras
            raise ValueError("tokenizer.json is written with the `tokenizers` package: "
                             "pip install 'tfjax[hf]'") from e

        # GPT-2's byte -> character map: printable bytes stand for themselves, the rest
        # take the alphabet's characters from U+0100 on, in byte order.
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        extra = iter(sorted(c for c in alphabet if ord(c) >= 256))
        vocab = {(chr(b) if chr(b) in alphabet else next(extra)): b for b in range(256)}
        specials = {"<|pad|>": self.pad_id, "<|begin_of_text|>": self.bos_id,
                    "<|end_of_text|>": self.eos_id}
        tok = Tokenizer(models.BPE(vocab=vocab | specials, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return _with_bos(tok, self.bos_id)


def _with_bos(tok, bos_id: int):
    """`tok` with a post-processor that puts `bos_id` before the text (only), as
    `PackedBatches` lays out each document."""
    from tokenizers import processors

    bos = tok.id_to_token(bos_id)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, bos_id)])
    return tok


def _types(node) -> set[str]:
    """Every "type" named in a tokenizer.json component (a Sequence's parts too)."""
    if isinstance(node, dict):
        return {node.get("type")} | set().union(*map(_types, node.values()))
    if isinstance(node, list):
        return set().union(*map(_types, node))
    return set()


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (needs the `tokenizers` package: the `hf`
    extra); its bos / eos / pad are those the files beside it declare (`declared_specials`).
    `name` (default `path`) is what it was asked for by, e.g. a directory."""

    def __init__(self, path: str, name: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on extras
            raise ValueError(f"data.tokenizer: {path!r} is a tokenizers JSON file, which needs the "
                             "`tokenizers` package: in the clone, .venv/bin/python -m pip install -e '.[hf]'") from e
        self.name = path if name is None else name
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self.bos_id, self.eos_id, self.pad_id = declared_specials(path, self._tok)
        ids = f"bos {self.bos_id}, eos {self.eos_id}, pad {self.pad_id}"
        self.fingerprint = hashlib.sha256((self._tok.to_str() + ids).encode()).hexdigest()
        self.token_bytes = np.zeros(self.vocab_size, np.int32)
        decoders = _types(json.loads(self._tok.to_str()).get("decoder"))
        for tok, i in vocab.items():
            if tok in specials or i >= self.vocab_size:
                continue
            if "ByteLevel" in decoders:  # one character per byte, as GPT-2's alphabet
                self.token_bytes[i] = len(tok)
            elif "ByteFallback" in decoders and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok):
                self.token_bytes[i] = 1
            else:
                self.token_bytes[i] = len(self._tok.decode([i], skip_special_tokens=False).encode())

    def encode(self, text):
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def hf_tokenizer(self):
        """A copy of the file's tokenizer whose post-processor puts `bos_id` before the
        text and adds nothing else, as training saw it (`encode` adds no specials)."""
        from tokenizers import Tokenizer

        return _with_bos(Tokenizer.from_str(self._tok.to_str()), self.bos_id)


class SentencePieceTokenizer:
    """A sentencepiece `.model` file (needs `pip install sentencepiece`)."""

    def __init__(self, path: str):
        try:
            import sentencepiece as spm
        except ImportError as e:  # pragma: no cover - depends on extras
            raise ValueError(f"data.tokenizer: {path!r} is a sentencepiece model, which needs "
                             "`pip install sentencepiece`") from e
        self.name = path
        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.fingerprint = hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else self.eos_id
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
        self.token_bytes = np.array([self._piece_bytes(i) for i in range(self.vocab_size)],
                                    np.int32)

    def _piece_bytes(self, i: int) -> int:
        # From the piece, not decode([i]): decoding drops a leading "▁" (space).
        sp = self._sp
        if sp.is_control(i) or sp.is_unknown(i):
            return 0
        if sp.is_byte(i):  # byte fallback "<0xAB>"
            return 1
        return len(sp.id_to_piece(i).replace("\u2581", " ").encode())

    def encode(self, text):
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def hf_tokenizer(self):
        """Refused: converting a sentencepiece model to `tokenizers` form is not done here
        (transformers' converters do it per model family)."""
        raise ValueError(f"tokenizer: {self.name!r} is a sentencepiece model, which tfjax does "
                         "not convert to tokenizer.json; export without tokenizer= and convert "
                         "it with transformers (e.g. LlamaTokenizerFast(vocab_file=...))")


def load_tokenizer(name: str):
    """"byte", a `tokenizers` .json file, a sentencepiece .model file, or a directory (a
    checkpoint or a tokenizer directory: its tokenizer.json, else its tokenizer.model),
    local or on a bucket (`gs://...`: the tokenizer's files are downloaded, the rest not)."""
    if name == "byte":
        return ByteTokenizer()
    local = _local_mirror(name) if storage.is_remote(name) else name
    if os.path.isdir(local):
        for file in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(local, file)):
                return _load_file(os.path.join(local, file), name)
        raise ValueError(f"data.tokenizer: the directory {name!r} has neither tokenizer.json nor "
                         "tokenizer.model; name a directory that has one (save_pretrained or "
                         "`python -m tfjax.data.tokenizer train` writes it) or a tokenizer file")
    if not os.path.exists(local):
        raise ValueError(f"data.tokenizer: {name!r} is neither 'byte' nor an existing file or "
                         "directory (a tokenizers .json, a sentencepiece .model, or a directory "
                         "holding tokenizer.json / tokenizer.model)")
    return _load_file(local, name)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a directory's, in this order


def _local_mirror(url: str) -> str:
    """The local copy of a tokenizer file or directory on a bucket, with the files beside
    it that declare its special tokens (`specials.DECLARING_FILES`)."""
    storage.check_reachable(url, "data.tokenizer", must_exist=True)
    if storage.path(url).is_dir():
        return storage.local_directory(url, (*TOKENIZER_FILES, *DECLARING_FILES))
    folder, file = url.rstrip("/").rsplit("/", 1)
    return os.path.join(storage.local_directory(folder, (file, *DECLARING_FILES)), file)


def _load_file(path: str, name: str):
    if path.endswith(".json"):
        with open(path) as f:
            json.load(f)  # a clear JSON error before the tokenizers library's
        return HFTokenizer(path, name)
    return SentencePieceTokenizer(path)
