"""Tokenizer files and directories: where a tokenizer.json's specials come from (the
files beside it), the missing-eos error, fingerprints, and `python -m
tfjax.data.tokenizer train` (a byte-level BPE that transformers reads alike)."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tfjax.data import load_tokenizer
from tfjax.data.tokenizer import HFTokenizer, SentencePieceTokenizer
from tfjax.data.tokenizer.__main__ import main
from tfjax.data.tokenizer.train import BOS, EOS, PAD, train

tokenizers = pytest.importorskip("tokenizers")  # the `hf` extra

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|eot|>"]  # ids 0..4
TEXTS = ["hello world, hello tokenizer", "the quick brown fox jumps", "def f(x):\n    return x"]
REPO = str(pathlib.Path(__file__).resolve().parents[2])
UNSEEN = "naïve 日本語 🙂 \t tabs  and  spaces\n"


def _word_level(folder, specials=SPECIALS, **files):
    """`folder`/tokenizer.json (a word-level vocabulary: `specials` first, then a few
    words) and each of `files` (name without .json -> its JSON object) beside it."""
    from tokenizers import AddedToken, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    vocab = {t: i for i, t in enumerate([*specials, "a", "b", "c"])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(os.path.join(folder, "tokenizer.json"))
    for name, content in files.items():
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(content, f)
    return str(folder)


def _specials(t):
    return t.bos_id, t.eos_id, t.pad_id


def test_specials_from_tokenizer_config_string_and_dict(tmp_path):
    d = _word_level(tmp_path / "s", tokenizer_config=dict(
        bos_token="<s>", eos_token="<|eot|>", pad_token="<pad>"))
    assert _specials(load_tokenizer(d)) == (1, 4, 3)
    d = _word_level(tmp_path / "d", tokenizer_config=dict(
        bos_token={"__type": "AddedToken", "content": "<s>", "special": True},
        eos_token={"content": "</s>"}, pad_token=None))
    assert _specials(load_tokenizer(d)) == (1, 2, 2)  # no pad declared: the eos


def test_specials_from_generation_config_and_config(tmp_path):
    d = _word_level(tmp_path / "g", generation_config=dict(eos_token_id=[4, 2]),
                    config=dict(bos_token_id=1, eos_token_id=0, pad_token_id=3))
    assert _specials(load_tokenizer(d)) == (1, 4, 3)  # a list's first id; config.json fills in
    d = _word_level(tmp_path / "c", config=dict(eos_token_id=2))
    assert _specials(load_tokenizer(d)) == (2, 2, 2)
    # per role, tokenizer_config.json before generation_config.json before config.json
    d = _word_level(tmp_path / "o", tokenizer_config=dict(eos_token="</s>"),
                    generation_config=dict(eos_token_id=4, bos_token_id=1),
                    config=dict(eos_token_id=0, bos_token_id=0, pad_token_id=3))
    assert _specials(load_tokenizer(d)) == (1, 2, 3)


def test_bare_file_with_one_special_token(tmp_path):
    """GPT-2's shape: one special token, `<|endoftext|>`, is eos, bos and pad."""
    d = _word_level(tmp_path, specials=["<|endoftext|>"])
    assert _specials(load_tokenizer(os.path.join(d, "tokenizer.json"))) == (0, 0, 0)


@pytest.mark.bad_input
def test_no_declared_eos_is_one_line_naming_files_and_fix(tmp_path):
    d = _word_level(tmp_path / "bare")
    with pytest.raises(ValueError) as e:
        load_tokenizer(os.path.join(d, "tokenizer.json"))
    msg = str(e.value)
    assert "\n" not in msg and "declares no end-of-text token" in msg
    assert "no tokenizer_config.json, generation_config.json or config.json in" in msg
    assert "</s>, <pad>, <s>, <unk>, <|eot|>" in msg  # what it could name
    assert f'add "eos_token": "<the end-of-text token>" to {d}/tokenizer_config.json' in msg
    d = _word_level(tmp_path / "partial", tokenizer_config=dict(bos_token="<s>"),
                    config=dict(bos_token_id=1))
    with pytest.raises(ValueError, match=rf"looked at: {d}/tokenizer_config.json, "
                       rf"{d}/config.json; .*add \"eos_token\""):
        load_tokenizer(d)


@pytest.mark.bad_input
@pytest.mark.parametrize("files, pattern", [
    (dict(tokenizer_config=dict(eos_token="<end>")),
     r"tokenizer_config.json: eos_token '<end>' is not in the tokenizer's vocabulary"),
    (dict(tokenizer_config=dict(eos_token=7)), r"tokenizer_config.json: eos_token is 7; it must"),
    (dict(generation_config=dict(eos_token_id=99)),
     r"generation_config.json: eos_token_id is 99, but it must be an id .* below the "
     r"tokenizer's 8 ids"),
    (dict(config=dict(eos_token_id="2")), r"config.json: eos_token_id is \"2\""),
    (dict(config=[1, 2]), r"config.json holds list, not a JSON object"),
])
def test_bad_declarations_are_one_line(tmp_path, files, pattern):
    d = _word_level(tmp_path, **files)
    with pytest.raises(ValueError, match=r"data.tokenizer: .*" + pattern) as e:
        load_tokenizer(d)
    assert "\n" not in str(e.value)


def test_directory_and_file_are_one_tokenizer(tmp_path):
    d = _word_level(tmp_path / "t", tokenizer_config=dict(eos_token="</s>", bos_token="<s>"))
    by_dir, by_file = load_tokenizer(d), load_tokenizer(os.path.join(d, "tokenizer.json"))
    assert isinstance(by_dir, HFTokenizer) and by_dir.name == d
    assert _specials(by_dir) == _specials(by_file) == (1, 2, 2)
    assert by_dir.fingerprint == by_file.fingerprint
    assert by_dir.encode("a b c").tolist() == by_file.encode("a b c").tolist() == [5, 6, 7]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"data.tokenizer: the directory .*empty' has neither "
                       r"tokenizer.json nor tokenizer.model"):
        load_tokenizer(str(tmp_path / "empty"))


def test_a_tokenizer_on_a_bucket_is_the_local_one(tmp_path, gcs_bucket):
    """A directory or a file on gs:// loads as its local original: the same ids, specials
    (declared by the files beside it, which come down with it) and fingerprint; what is
    not the tokenizer's (weights) stays on the bucket."""
    from tfjax import storage

    d = _word_level(tmp_path / "t", generation_config=dict(eos_token_id=4, bos_token_id=1))
    (tmp_path / "t" / "model.safetensors").write_bytes(b"weights")
    for f in os.listdir(d):
        storage.upload(os.path.join(d, f), f"{gcs_bucket}/tok/{f}")
    here = load_tokenizer(d)
    for url in (f"{gcs_bucket}/tok", f"{gcs_bucket}/tok/tokenizer.json"):
        there = load_tokenizer(url)
        assert there.name == url and _specials(there) == _specials(here) == (1, 4, 4)
        assert there.fingerprint == here.fingerprint
        assert there.encode("a b c").tolist() == here.encode("a b c").tolist()
    downloaded = {f for _, _, fs in os.walk(storage.download_directory()) for f in fs}
    assert "generation_config.json" in downloaded and "model.safetensors" not in downloaded
    with pytest.raises(ValueError, match=r"^data.tokenizer: gs://.*/tok/absent does not exist"):
        load_tokenizer(f"{gcs_bucket}/tok/absent")


def test_directory_with_a_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "corpus.txt").write_text("\n".join(TEXTS * 30))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=60,
        model_type="bpe", byte_fallback=False, bos_id=1, eos_id=2, pad_id=3, unk_id=0,
        minloglevel=2)
    (tmp_path / "dir").mkdir()
    shutil.copy(tmp_path / "sp.model", tmp_path / "dir" / "tokenizer.model")
    t = load_tokenizer(str(tmp_path / "dir"))
    assert isinstance(t, SentencePieceTokenizer) and _specials(t) == (1, 2, 3)
    assert t.fingerprint == load_tokenizer(str(tmp_path / "sp.model")).fingerprint


def test_fingerprints(tmp_path):
    a = _word_level(tmp_path / "a", tokenizer_config=dict(eos_token="</s>"))
    copy = _word_level(tmp_path / "copy", tokenizer_config=dict(eos_token="</s>"))
    other_eos = _word_level(tmp_path / "e", tokenizer_config=dict(eos_token="<|eot|>"))
    other_vocab = _word_level(tmp_path / "v", specials=["<unk>", "<s>", "</s>", "<pad>", "<x>"],
                              tokenizer_config=dict(eos_token="</s>"))
    fp = load_tokenizer(a).fingerprint
    assert fp == load_tokenizer(a).fingerprint == load_tokenizer(copy).fingerprint
    assert len({fp, load_tokenizer(other_eos).fingerprint,
                load_tokenizer(other_vocab).fingerprint, load_tokenizer("byte").fingerprint}) == 4


def _corpus(tmp_path):
    (tmp_path / "docs").mkdir()
    with open(tmp_path / "docs" / "a.jsonl", "w") as f:
        for t in TEXTS * 20:
            f.write(json.dumps({"body": t, "id": 1}) + "\n\n")
    (tmp_path / "docs" / "code.py").write_text("import os\nprint(os.getcwd())\n" * 10)
    return str(tmp_path / "docs")


def test_train_round_trips_and_transformers_agrees(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = train([_corpus(tmp_path)], str(tmp_path / "tok"), 300, field="body", progress=False)
    t = load_tokenizer(out)
    assert 259 < t.vocab_size <= 300 and t.name == out
    raw = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert _specials(t) == tuple(raw.token_to_id(s) for s in (BOS, EOS, PAD)) == (1, 2, 0)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == _specials(t)
    for text in [*TEXTS, UNSEEN, ""]:
        ids = t.encode(text)
        assert t.decode(ids) == text
        assert fast.encode(text, add_special_tokens=False) == ids.tolist()
        assert auto(text).input_ids == [t.bos_id, *ids.tolist()]  # bos first, as training
        assert t.token_bytes[ids].sum() == len(text.encode())
    assert len(t.encode(TEXTS[0])) < len(TEXTS[0].encode()) / 2  # merges were learned
    assert t.token_bytes[list(_specials(t))].tolist() == [0, 0, 0]


def test_save_pretrained_directory_agrees_with_auto_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    src = _word_level(tmp_path / "src")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(src, "tokenizer.json"), bos_token="<s>", eos_token="<|eot|>",
        pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(str(tmp_path / "saved"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    t = load_tokenizer(str(tmp_path / "saved"))
    assert _specials(t) == (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (1, 4, 3)


@pytest.mark.bad_input
def test_train_bad_input(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    cases = [
        ([str(tmp_path / "nothing*.txt")], r"nothing\*.txt' matches no file"),
        ([corpus, "--vocab_size", "100"], r"--vocab_size 100 is below 259"),
        ([corpus], r"a.jsonl:1: the record has no field 'text' \(--field\)"),
    ]
    for args, pattern in cases:
        argv = ["train", *args, "--output", str(tmp_path / "o"), "--no-progress"]
        if "--vocab_size" not in args:
            argv += ["--vocab_size", "300"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: tokenizer train: ")
        assert re.search(pattern, err), err
    assert not os.path.exists(tmp_path / "o")


def test_train_command_line(tmp_path):
    corpus = _corpus(tmp_path)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "tfjax.data.tokenizer", "train",
                        os.path.join(corpus, "*.jsonl"), "--output", str(tmp_path / "tok"),
                        "--vocab_size", "280", "--field", "body", "--min_frequency", "3"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "60 documents]" in r.stderr and "tokenizer.json" in r.stderr
    assert r.stdout == ""
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (BOS, EOS, PAD)
    assert load_tokenizer(str(tmp_path / "tok")).vocab_size <= 280
