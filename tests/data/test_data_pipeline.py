"""Tokenizer, corpus split, packing, per-process shares and resumable iterator state."""

import hashlib
import json
import os
import sysconfig

import numpy as np
import pytest

from tfjax.config import DataConfig
from tfjax.data import (
    ByteTokenizer,
    PackedBatches,
    documents,
    load_tokenizer,
    stdlib_files,
)


def test_byte_tokenizer_roundtrip_and_specials():
    tok = load_tokenizer("byte")
    text = "héllo\n\tworld ∑"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode(list(ids) + [tok.eos_id, tok.pad_id]) == text
    assert tok.vocab_size == 259 and {tok.pad_id, tok.bos_id, tok.eos_id} == {256, 257, 258}
    assert tok.token_bytes[:256].sum() == 256 and tok.token_bytes[256:].sum() == 0


def test_tokenizer_file_errors(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer: 'nope.json' is neither"):
        load_tokenizer("nope.json")


def test_stdlib_split_rule():
    root = sysconfig.get_paths()["stdlib"]
    train, val = stdlib_files("train"), stdlib_files("validation")
    assert len(train) > 500 and 5 < len(val) < len(train) // 20
    assert not set(train) & set(val)
    for p in train[:50] + val:
        rel = os.path.relpath(p, root).replace(os.sep, "/")
        parts = rel.split("/")[:-1]
        assert "test" not in parts and "site-packages" not in parts and rel.endswith(".py")
        in_val = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0
        assert in_val == (p in val)


def _stream(src, tok, **kw):
    kw = dict(seq_len=64, global_batch=4, shuffle=False, repeat=False) | kw
    return PackedBatches(src, tok, **kw)


def test_packing_covers_every_byte_once_without_crossing_documents():
    tok = ByteTokenizer()
    src = documents(DataConfig(), "validation")
    total = sum(len(src[i]) for i in range(len(src)))
    got, seen_bytes = 0, {r: [] for r in range(4)}
    it = _stream(src, tok)
    batches = list(it)
    assert len(batches) == it.num_batches()
    for b in batches:
        got += int(b["target_bytes"].sum())
        for r in range(b["inputs"].shape[0]):
            keep = (b["mask"][r] > 0) & (b["targets"][r] < 256)
            seen_bytes[r].append(b["targets"][r][keep].astype(np.uint8).tobytes())
            seg, pos, m = b["segment_ids"][r], b["positions"][r], b["mask"][r]
            for s in np.unique(seg[seg > 0]):  # positions restart at 0 for every piece
                np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
            starts = np.flatnonzero(np.diff(seg) != 0)  # last token of a piece predicts nothing
            assert (m[starts] == 0).all()
            assert (m[seg == 0] == 0).all()
    assert got == total  # every byte of the split is a counted target exactly once
    # row r reads documents r, r+4, r+8, ... in order, each whole
    for r in range(4):
        assert b"".join(seen_bytes[r]) == b"".join(src[k] for k in range(r, len(src), 4))
    # streams that ran out give empty rows; the longest stream sets the batch count
    assert (batches[-1]["segment_ids"] == 0).all(axis=1).any() or len(src) < 4


def test_targets_are_next_inputs():
    tok = ByteTokenizer()
    it = _stream(documents(DataConfig(), "train"), tok, repeat=True, shuffle=True)
    b, c = next(it), next(it)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    # a row of the next batch starts on the same row's last token: no gaps
    np.testing.assert_array_equal(c["inputs"][:, 0], b["targets"][:, -1])
    # the rows of one batch come from different documents
    assert len({bytes(b["inputs"][r, :32].astype(np.uint8)) for r in range(4)}) == 4


def test_seeded_shuffle():
    tok = ByteTokenizer()
    src = documents(DataConfig(), "train")
    a = next(_stream(src, tok, shuffle=True, repeat=True, seed=1))["inputs"]
    b = next(_stream(src, tok, shuffle=True, repeat=True, seed=1))["inputs"]
    c = next(_stream(src, tok, shuffle=True, repeat=True, seed=2))["inputs"]
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_state_resumes_exactly():
    tok = ByteTokenizer()
    src = documents(DataConfig(), "train")
    it = _stream(src, tok, shuffle=True, repeat=True, seed=3)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # checkpointed as JSON
    expect = [next(it) for _ in range(3)]
    it2 = _stream(src, tok, shuffle=True, repeat=True, seed=3)
    it2.set_state(state)
    for e in expect:
        g = next(it2)
        for k in e:
            np.testing.assert_array_equal(g[k], e[k])


def test_process_shares_partition_the_global_batch():
    tok = ByteTokenizer()
    src = documents(DataConfig(), "train")
    full = next(_stream(src, tok, global_batch=8, repeat=True))
    halves = [next(_stream(src, tok, global_batch=8, repeat=True, local_rows=rows))
              for rows in (range(4), range(4, 8))]
    for k in full:
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), full[k])


def test_text_glob_and_jsonl_sources(tmp_path):
    for i in range(100):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n" * 3)
    cfg = DataConfig(source="text", paths=(str(tmp_path / "*.txt"),))
    train, val = documents(cfg, "train"), documents(cfg, "validation")
    # the sha1 rule on the name relative to the glob's directory: doc66.txt only
    assert len(train) == 99 and len(val) == 1 and val[0] == b"document 66\n" * 3
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"text": f"record {i}", "id": i}) + "\n")
    cfg = DataConfig(source="jsonl", paths=(str(tmp_path / "d.jsonl"),),
                     val_paths=(str(tmp_path / "d.jsonl"),))
    docs = documents(cfg, "train")
    assert len(docs) == 10 and docs[3] == b"record 3"
    b = next(_stream(docs, ByteTokenizer(), seq_len=16, global_batch=2, repeat=True))
    assert b["inputs"].shape == (2, 16)


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    cfg = DataConfig(source="text", paths=(str(tmp_path / "a.txt"),))
    with pytest.raises(ValueError, match="data.paths: the validation split is empty"):
        documents(cfg, "validation")
    with pytest.raises(ValueError, match="data.paths: .*matches no file"):
        documents(DataConfig(source="text", paths=(str(tmp_path / "*.md"),)), "train")


def test_paths_are_found_as_prepare_finds_its_inputs(tmp_path):
    """data.paths takes files, globs and directories (one home: inputs.find_inputs);
    hidden files are skipped; split keys are relative to the pattern's directory; what
    only a token cache reads, or a bucket, is one line naming the fix."""
    from tfjax.data.sources import expand_paths

    (tmp_path / "c" / "sub").mkdir(parents=True)
    for name in ("c/a.txt", "c/sub/b.txt", "c/.hidden.txt", "c/sub/.x.txt"):
        (tmp_path / name).write_text("doc")
    want = [(str(tmp_path / "c" / "a.txt"), "a.txt"),
            (str(tmp_path / "c" / "sub" / "b.txt"), "sub/b.txt")]
    assert expand_paths([str(tmp_path / "c")], "data.paths") == want
    assert expand_paths([str(tmp_path / "c" / "**" / "*.txt")], "data.paths") == want
    assert len(documents(DataConfig(source="text", paths=(str(tmp_path / "c"),),
                                    val_paths=(str(tmp_path / "c" / "a.txt"),)), "train")) == 2
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"^data.paths: .*t.parquet is a parquet; .*python -m "
                                         r"tfjax.data.prepare.*data.source='cache'"):
        expand_paths([str(tmp_path / "t.parquet")], "data.paths")
    with pytest.raises(ValueError, match=r"^data.val_paths: '.*nope.txt': no such file"):
        expand_paths([str(tmp_path / "nope.txt")], "data.val_paths")


def test_local_tokenizers_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")  # the `hf` extra
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainer)
    path = str(tmp_path / "tok.json")
    tok.save(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(  # declares the specials
        dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>")))
    t = load_tokenizer(path)
    ids = t.encode("def f(x):")
    assert t.decode(ids) == "def f(x):"
    assert t.eos_id == tok.token_to_id("</s>") and t.token_bytes[t.eos_id] == 0
    assert t.token_bytes[ids].sum() == len(b"def f(x):")
    # in tokenizers form (an export's tokenizer.json): BOS first, as training laid it out
    assert t.hf_tokenizer().encode("def f(x):").ids == [t.bos_id, *ids.tolist()]


def test_byte_tokenizer_in_tokenizers_form():
    pytest.importorskip("tokenizers")  # the `hf` extra
    tok = ByteTokenizer()
    hf_tok = tok.hf_tokenizer()
    text = "héllo <s> wörld 日本\n\t  x  " + "".join(map(chr, range(256)))
    assert hf_tok.encode(text).ids == [tok.bos_id, *tok.encode(text).tolist()]
    assert hf_tok.decode(tok.encode(text).tolist()) == text
    every_byte = bytes(range(256))
    assert hf_tok.decode(list(every_byte)) == tok.decode(list(every_byte))  # bad UTF-8 too
    assert [hf_tok.token_to_id(t) for t in ("<|pad|>", "<|begin_of_text|>", "<|end_of_text|>")] == [
        tok.pad_id, tok.bos_id, tok.eos_id]


def test_local_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")  # the `hf` extra
    text = "def f(x):\n    return x + 1\nclass A:\n    pass\n"
    (tmp_path / "corpus.txt").write_text(text * 40)
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=300,
        model_type="bpe", byte_fallback=True, bos_id=1, eos_id=2,
        pad_id=3, unk_id=0, minloglevel=2, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_by_whitespace=False)
    t = load_tokenizer(str(tmp_path / "sp.model"))
    assert (t.vocab_size, t.bos_id, t.eos_id, t.pad_id) == (300, 1, 2, 3)
    sample = "def g(y):\n    return y + 1 ü"  # "ü" is not in the corpus: byte fallback
    ids = t.encode(sample)
    assert t.decode(ids) == sample
    # bits/byte needs the byte count of every token, spaces and fallbacks included;
    # sentencepiece's dummy prefix (a space before the text, as in Llama's) is one more
    assert t.token_bytes[ids].sum() == len(sample.encode()) + 1
    assert t.token_bytes[[0, 1, 2, 3]].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="sentencepiece model, which tfjax does not convert"):
        t.hf_tokenizer()
