"""The bos / eos / pad ids of a `tokenizers` JSON file, read from the files that declare
them: `tokenizer_config.json` beside it (`bos_token`, `eos_token`, `pad_token`), then
`generation_config.json` and `config.json` (`*_token_id`; a list's first id). A file
with none beside it: its one added special token, if it has exactly one. No eos is a
one-line ValueError naming the files looked at and the fix. See docs/data.md.
"""

from __future__ import annotations

import json
import os

__all__ = ["DECLARING_FILES", "declared_specials"]

ROLES = ("bos", "eos", "pad")
ID_FILES = ("generation_config.json", "config.json")  # generation_config: as HF generate
DECLARING_FILES = ("tokenizer_config.json", *ID_FILES)  # what declared_specials reads


def _read(path: str, where: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {path} is not readable JSON ({e}); fix or remove it") from None
    if not isinstance(d, dict):
        raise ValueError(f"{where}: {path} holds {type(d).__name__}, not a JSON object")
    return d


def _token_id(value, file: str, key: str, vocab: dict, where: str) -> int | None:
    """tokenizer_config.json's `key` (a string or an AddedToken dict) as an id."""
    content = value.get("content") if isinstance(value, dict) else value
    if content is None:
        return None
    if not isinstance(content, str):
        raise ValueError(f"{where}: {file}: {key} is {json.dumps(value)}; it must be a token "
                         'string or {"content": "..."}')
    if content not in vocab:
        raise ValueError(f"{where}: {file}: {key} {content!r} is not in the tokenizer's "
                         "vocabulary; name one of its tokens")
    return vocab[content]


def _id(value, file: str, key: str, size: int, where: str) -> int | None:
    """config.json / generation_config.json's `key`: an id, or a list whose first id counts."""
    first = value[0] if isinstance(value, list) and value else value
    if first is None or value == []:
        return None
    if type(first) is not int or not 0 <= first < size:
        raise ValueError(f"{where}: {file}: {key} is {json.dumps(value)}, but it must be an id "
                         f"(or a list of ids) below the tokenizer's {size} ids")
    return first


def declared_specials(path: str, tok, where: str = "data.tokenizer") -> tuple[int, int, int]:
    """(bos, eos, pad) of the `tokenizers.Tokenizer` `tok` read from `path`. Per role,
    the first file beside `path` that declares it wins, in the module docstring's order;
    a bos or pad no file declares is the eos."""
    folder = os.path.dirname(os.path.abspath(path))
    vocab = tok.get_vocab(with_added_tokens=True)
    size = tok.get_vocab_size(with_added_tokens=True)
    found: dict[str, int] = {}
    looked = []
    file = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(file):
        looked.append(file)
        d = _read(file, where)
        for role in ROLES:
            i = _token_id(d.get(f"{role}_token"), file, f"{role}_token", vocab, where)
            if i is not None:
                found.setdefault(role, i)
    for name in ID_FILES:
        file = os.path.join(folder, name)
        if os.path.isfile(file):
            looked.append(file)
            d = _read(file, where)
            for role in ROLES:
                i = _id(d.get(f"{role}_token_id"), file, f"{role}_token_id", size, where)
                if i is not None:
                    found.setdefault(role, i)
    if "eos" not in found:
        specials = sorted(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
        if len(specials) == 1:
            found["eos"] = vocab[specials[0]]
        else:
            files = ", ".join(looked) or f"no tokenizer_config.json, generation_config.json or config.json in {folder}"
            raise ValueError(
                f"{where}: {path!r} declares no end-of-text token (looked at: {files}; its "
                f"special tokens: {', '.join(specials) or 'none'}); add \"eos_token\": \"<the "
                f"end-of-text token>\" to {os.path.join(folder, 'tokenizer_config.json')}, or "
                "pass a checkpoint directory that declares one")
    return found.get("bos", found["eos"]), found["eos"], found.get("pad", found["eos"])
