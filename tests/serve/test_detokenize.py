"""Incremental detokenization: pieces of whole characters only that concatenate to the
whole decoded text, the prompt's last tokens as context, stop strings held back and cut."""

from __future__ import annotations

import numpy as np
import pytest
from serve_fixtures import WRITES, cycle, tokenizer

from tfjax.serve.detokenize import Detokenizer, SampleText


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def decoder(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def pieces(text: SampleText, ids, stopped=False):
    out = [text.add(t) for t in ids[:-1]]
    return out + [text.add(ids[-1], final=True, stopped=stopped)]


def test_pieces_are_whole_characters(tok):
    ids = cycle(tok)
    d = Detokenizer(decoder(tok))
    got = [d.add(t) for t in ids] + [d.flush()]
    # "ü" is two byte tokens, "→", "東" and "京" three: each comes out whole
    assert [p for p in got if p] == ["Z", "ü", "r", "i", "ch", "→", "東", "京", "!"]
    assert "".join(got) == WRITES


def test_random_tokens_concatenate_to_the_whole_text(tok):
    rng = np.random.default_rng(0)
    decode = decoder(tok)
    for _ in range(20):
        ids = rng.integers(0, len(tok), rng.integers(1, 30)).tolist()
        prompt = rng.integers(0, len(tok), rng.integers(0, 8)).tolist()
        d = Detokenizer(decode, prompt)
        got = [d.add(t) for t in ids] + [d.flush()]
        # a split character would show as two replacement characters, not one
        assert "".join(got) == decode(ids), (prompt, ids)


def test_the_prompt_keeps_a_leading_space_a_tokenizer_drops_at_the_start():
    vocab = {0: "▁The", 1: "▁Paris", 2: "!"}
    decode = lambda ids: "".join(vocab[i] for i in ids).replace("▁", " ").lstrip(" ")  # noqa
    assert Detokenizer(decode).add(1) == "Paris"
    d = Detokenizer(decode, prompt=[0])
    assert [d.add(1), d.add(2), d.flush()] == [" Paris", "!", ""]


def test_an_incomplete_character_is_held_until_the_end(tok):
    first_byte_of_ue = cycle(tok)[1]  # "ü" is 0xC3 0xBC
    d = Detokenizer(decoder(tok))
    assert d.add(first_byte_of_ue) == ""
    assert d.flush() == "\ufffd"  # no byte will complete it


def test_a_stop_string_is_held_back_then_cut(tok):
    text = SampleText(decoder(tok), stop=["東京"])
    got = pieces(text, cycle(tok)[:15], stopped=True)  # the engine stopped after 京
    assert "".join(got) == text.answer == "Zürich→"
    assert all("東" not in p for p in got)


def test_held_text_goes_out_once_it_cannot_begin_a_stop_string(tok):
    ids = cycle(tok)  # Z, ü (2 bytes), r, i, ch, → (3), 東 (3), 京 (3), !
    text = SampleText(decoder(tok), stop=["→X", "ichZ"])
    got = [text.add(t) for t in ids[:5]]
    assert "".join(got) == "Zür"  # "i" may begin "ichZ"
    assert [text.add(t) for t in ids[5:8]] == ["", "", ""]  # "ich", then half an "→"
    assert text.add(ids[8]) == "ich"  # "ichZ" no more, but "→" may begin "→X"
    assert [text.add(t) for t in ids[9:12]] == ["", "", "→東"]
    rest = [text.add(t) for t in ids[12:-1]] + [text.add(ids[-1], final=True)]
    assert "Zür" + "ich→東" + "".join(rest) == text.answer == WRITES  # never stopped


def test_at_the_end_held_text_is_sent(tok):
    text = SampleText(decoder(tok), stop=["!Q", ""])  # an empty stop string is none
    got = [text.add(t) for t in cycle(tok)]
    assert got[-1] == "" and "".join(got) == WRITES[:-1]  # "!" may begin "!Q"
    assert text.add(None, final=True) == "!"  # the sample ended (max_tokens): it goes out
    assert text.answer == WRITES


def test_an_aborted_sample_sends_what_it_has(tok):
    text = SampleText(decoder(tok), stop=["東"])
    ids = cycle(tok)[:7]  # "Zürich" and the first byte of "→"
    got = [text.add(t) for t in ids] + [text.add(None, final=True)]
    assert "".join(got) == text.answer == "Zürich\ufffd"
