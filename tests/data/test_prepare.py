"""`python -m tfjax.data.prepare`: every input kind gives the documents tokenizing them
directly gives, split by `is_validation` of their names; a killed prepare resumes to
byte-identical shards; a rerun does nothing; other inputs into the same DIR and bad
input are one-line errors naming the file, the line / row and the field."""

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tfjax.data import is_validation, load_tokenizer
from tfjax.data.cache import TokenCache
from tfjax.data.prepare import main, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MB = 300 / 2**20  # shards of ~300 input bytes: several shards from tiny inputs
N = 120  # records per file: a few of them go to validation (1 in 50)


def _texts(tag: str, n: int = N) -> list[str]:
    return [f"{tag} document {i}: " + "héllo wörld " * (i % 5) for i in range(n)]


def _jsonl(texts, field="text") -> bytes:
    return b"".join(json.dumps({field: t, "id": i}).encode() + b"\n" for i, t in enumerate(texts))


# Each kind: (writer(dir) -> [(name, text)] the documents it must give, in order).
def _kind_jsonl(d):
    (d / "a.jsonl").write_bytes(_jsonl(_texts("jsonl")) + b"\n")  # a trailing blank line
    return [(f"a.jsonl:{i}", t) for i, t in enumerate(_texts("jsonl"))]


def _kind_jsonl_gz(d):
    (d / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(_texts("gz"))))
    return [(f"a.jsonl.gz:{i}", t) for i, t in enumerate(_texts("gz"))]


def _kind_jsonl_zst(d):
    zstd = pytest.importorskip("zstandard")
    (d / "a.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(_jsonl(_texts("zst"))))
    return [(f"a.jsonl.zst:{i}", t) for i, t in enumerate(_texts("zst"))]


def _kind_json_list(d):
    (d / "a.json").write_text(json.dumps([{"text": t} for t in _texts("list")], indent=2))
    return [(f"a.json:{i}", t) for i, t in enumerate(_texts("list"))]


def _kind_json_lines(d):
    (d / "b.json").write_bytes(_jsonl(_texts("jsonlines")))
    return [(f"b.json:{i}", t) for i, t in enumerate(_texts("jsonlines"))]


def _kind_parquet(d):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = _texts("parquet")
    pq.write_table(pa.table({"id": list(range(N)), "text": texts}), d / "a.parquet",
                   row_group_size=17)
    return [(f"a.parquet:{i}", t) for i, t in enumerate(texts)]


def _kind_dataset(d):
    datasets = pytest.importorskip("datasets")
    texts = _texts("dataset")
    datasets.Dataset.from_dict({"text": texts, "id": list(range(N))}).save_to_disk(str(d / "ds"))
    return [(f"ds:{i}", t) for i, t in enumerate(texts)]


def _kind_dataset_dict(d):
    datasets = pytest.importorskip("datasets")
    texts = _texts("dsdict")
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["not read"] * 3}),
                          "train": datasets.Dataset.from_dict({"text": texts})}
                         ).save_to_disk(str(d / "dd"))
    return [(f"dd:{i}", t) for i, t in enumerate(texts)]  # its train split only


def _kind_text(d):
    (d / "sub").mkdir()
    names = [f"sub/f{i:03d}.txt" for i in range(N)]
    for name, t in zip(names, _texts("text")):
        (d / name).write_text(t)
    (d / "blank.md").write_text("  \n")  # blank: skipped
    (d / ".hidden").write_text("skipped")
    return sorted(zip(names, _texts("text")))


KINDS = {"jsonl": _kind_jsonl, "jsonl.gz": _kind_jsonl_gz, "jsonl.zst": _kind_jsonl_zst,
         "json list": _kind_json_list, "json lines": _kind_json_lines,
         "parquet": _kind_parquet, "dataset": _kind_dataset, "dataset dict": _kind_dataset_dict,
         "text": _kind_text}


def _stream(docs, tok) -> np.ndarray:
    parts = [np.concatenate([[tok.bos_id], tok.encode(t.encode() if isinstance(t, str) else t),
                             [tok.eos_id]]) for _, t in docs]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def _check(out, docs, tok):
    """The cache at `out` holds `docs` (names, texts), split by is_validation, in order."""
    for split in ("train", "validation"):
        mine = [(n, t) for n, t in docs if is_validation(n) == (split == "validation")]
        assert mine, f"test data without {split} documents"
        cache = TokenCache(str(out), split)
        assert cache.num_documents == len(mine)
        stream = cache.read(0, cache.stream_length)
        np.testing.assert_array_equal(stream[0], _stream(mine, tok))
        assert np.all(np.diff(stream[1]) >= 0) and stream[1][-1] == len(mine) - 1


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_input_kind_gives_its_documents(tmp_path, kind):
    (src := tmp_path / "src").mkdir()
    docs = KINDS[kind](src)
    meta = prepare([str(src)], str(tmp_path / "out"), "byte", workers=1, shard_mb=TINY_MB)
    whole = kind in ("jsonl.gz", "jsonl.zst", "json list", "json lines")  # read from the start
    assert (len(meta["splits"]["train"]["shards"]) == 1) == whole
    _check(tmp_path / "out", docs, load_tokenizer("byte"))
    assert meta["num_documents"] == len(docs)


def test_a_directory_mixing_every_kind(tmp_path):
    (src := tmp_path / "src").mkdir()
    docs = []
    for kind in ("text", "jsonl", "json list", "parquet", "dataset", "jsonl.gz"):
        (src / kind.replace(" ", "_")).mkdir()
        docs += [(f"{kind.replace(' ', '_')}/{n}", t)
                 for n, t in KINDS[kind](src / kind.replace(" ", "_"))]
    docs.sort(key=lambda d: d[0].split(":")[0])  # sorted by relative path, as sorted(glob)
    meta = prepare([str(src)], str(tmp_path / "out"), "byte", workers=1, shard_mb=TINY_MB)
    _check(tmp_path / "out", docs, load_tokenizer("byte"))
    m = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert m == meta and m["num_documents"] == len(docs)
    assert m["num_tokens"] == sum(len(t.encode()) for _, t in docs)
    assert m["dtype"] == "uint16" and (m["bos_id"], m["eos_id"], m["vocab_size"]) == (257, 258, 259)
    assert m["tokenizer"] == "byte" and m["tokenizer_fingerprint"] == load_tokenizer("byte").fingerprint
    for split in ("train", "validation"):
        s = m["splits"][split]
        assert s["num_documents"] == sum(e["num_documents"] for e in s["shards"])
        assert all(len(e["sha256"]) == 64 for e in s["shards"])


def test_globs_name_documents_relative_to_the_glob_directory(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.jsonl").write_bytes(_jsonl(_texts("g")))
    (tmp_path / "c" / "y.txt").write_text("not matched")
    prepare([str(tmp_path / "c" / "*.jsonl")], str(tmp_path / "out"), "byte", workers=1)
    _check(tmp_path / "out", [(f"x.jsonl:{i}", t) for i, t in enumerate(_texts("g"))],
           load_tokenizer("byte"))


def _tree(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def corpus(tmp_path):
    (src := tmp_path / "src").mkdir()
    _kind_jsonl(src)
    _kind_text(src)
    return src


def test_resume_gives_byte_identical_shards(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    prepare([str(corpus)], str(out), "byte", workers=1, shard_mb=TINY_MB)
    first = _tree(out)
    assert sum(n.endswith(".arrayrecord") for n in first) > 4
    # killed: no metadata, a shard missing, another cut short, one left as a temporary file
    (out / "metadata.json").unlink()
    (out / "train" / "00001.arrayrecord").unlink()
    (out / "train" / "00002.arrayrecord").write_bytes(first["train/00002.arrayrecord"][:1000])
    (out / "validation" / "00003.json").unlink()
    (out / "train" / "00004.arrayrecord").rename(out / "train" / "00004.arrayrecord.tmp")
    (out / "train" / "00004.json").unlink()
    capsys.readouterr()
    prepare([str(corpus)], str(out), "byte", workers=1, shard_mb=TINY_MB)
    assert "resuming" in capsys.readouterr().err
    again = _tree(out)
    assert again.keys() - first.keys() == set() or all(k.endswith(".tmp") for k in again.keys()
                                                        - first.keys())
    assert {k: v for k, v in again.items() if not k.endswith(".tmp")} == first


def test_a_flipped_byte_in_a_finished_shard_is_rewritten(tmp_path, corpus):
    out = tmp_path / "out"
    prepare([str(corpus)], str(out), "byte", workers=1, shard_mb=TINY_MB)
    first = _tree(out)
    (out / "metadata.json").unlink()
    shard = out / "train" / "00000.arrayrecord"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 1
    shard.write_bytes(bytes(data))
    prepare([str(corpus)], str(out), "byte", workers=1, shard_mb=TINY_MB)
    assert _tree(out) == first


def test_a_finished_prepare_is_left_as_it_is(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    meta = prepare([str(corpus)], str(out), "byte", workers=1, shard_mb=TINY_MB)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()
    assert prepare([str(corpus)], str(out), "byte", workers=1, shard_mb=TINY_MB) == meta
    assert "already prepared" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamps


def _bpe(path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_texts("bpe", 50), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tok.save(str(path))
    (path.parent / "tokenizer_config.json").write_text(  # where its specials are declared
        json.dumps(dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>")))
    return str(path)


def test_another_tokenizer_or_other_inputs_into_the_same_dir_are_refused(tmp_path, corpus):
    out = tmp_path / "out"
    prepare([str(corpus)], str(out), "byte", workers=1)
    with pytest.raises(ValueError, match=r"holds the token cache of other inputs: it was made with "
                       r"tokenizer 'byte' .*not '.*tok.json'.*give another --output, or delete"):
        prepare([str(corpus)], str(out), _bpe(tmp_path / "tok.json"), workers=1)
    (corpus / "new.txt").write_text("one more")
    with pytest.raises(ValueError, match=r"its inputs differ \(122 there, 123 now; input 3: "
                       r"sub/f000.txt .* there, new.txt \(text, 8 bytes\) now\)"):
        prepare([str(corpus)], str(out), "byte", workers=1)
    with pytest.raises(ValueError, match="its field is 'text', not 'body'"):
        prepare([str(tmp_path / "src" / "a.jsonl")], str(out), "byte", field="body", workers=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and not a token cache"):
        prepare([str(corpus)], str(tmp_path / "other"), "byte", workers=1)


def test_a_bpe_tokenizer(tmp_path, corpus):
    path = _bpe(tmp_path / "tok.json")
    meta = prepare([str(corpus)], str(tmp_path / "out"), path, workers=1, shard_mb=TINY_MB)
    tok = load_tokenizer(path)
    assert meta["tokenizer_fingerprint"] == tok.fingerprint and meta["bos_id"] == tok.bos_id
    docs = [(f"a.jsonl:{i}", t) for i, t in enumerate(_texts("jsonl"))] + \
        sorted(zip([f"sub/f{i:03d}.txt" for i in range(N)], _texts("text")))
    _check(tmp_path / "out", docs, tok)


# (file name, content, message after the path)
BAD = [
    ("a.jsonl", b'{"text": "ok"}\n{"body": "x", "n": 1}\n',
     r":2: the record has no field 'text' \(--field\); its fields: body, n; set --field to the "
     r"one that holds the text \(string fields: body\)"),
    ("a.jsonl", b'{"text": "ok"}\n{"text": 42}\n',
     r":2: field 'text' \(--field\) is a number, not a string; point --field at"),
    ("a.jsonl", b'{"text": "ok"}\nnot json\n', r":2: not a JSON line \(Expecting value"),
    ("a.jsonl", b'["text"]\n', r":1: the record is a list, not a JSON object"),
    ("a.json", b'[{"text": "ok"}, {"text": null}]', r": item 1 \(0-based\): field 'text' "
     r"\(--field\) is null, not a string"),
    ("a.jsonl.gz", b"not gzip at all", r": cannot read \(.*\); check the file"),
    ("a.parquet", b"not parquet", r": not a readable parquet file \(.*\); check the file"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("name,content,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_records_name_file_line_and_field(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match="^" + re.escape(str(tmp_path / name)) + message) as e:
        prepare([str(tmp_path / name)], str(tmp_path / "out"), "byte", workers=1)
    assert "\n" not in str(e.value)


@pytest.mark.bad_input
def test_bad_columns_name_file_row_and_field(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a.parquet: no column 'text' \(--field\); its columns: "
                       r"body; set --field"):
        prepare([str(tmp_path / "a.parquet")], str(tmp_path / "o1"), "byte", workers=1)
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet: row 1 \(0-based\): field 'text' \(--field\) "
                       r"is null"):
        prepare([str(tmp_path / "b.parquet")], str(tmp_path / "o2"), "byte", workers=1)
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=r"ds: no column 'text' \(--field\); its columns: body"):
        prepare([str(tmp_path / "ds")], str(tmp_path / "o3"), "byte", workers=1)
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"dd: a DatasetDict without a 'train' split \(splits: "
                       r"test\); give the split's directory, e.g. .*dd/test"):
        prepare([str(tmp_path / "dd")], str(tmp_path / "o4"), "byte", workers=1)


@pytest.mark.bad_input
def test_empty_or_missing_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"input '.*empty' matches no file"):
        prepare([str(tmp_path / "empty")], str(tmp_path / "out"), "byte", workers=1)
    with pytest.raises(ValueError, match=r"input '.*\*.jsonl' matches no file"):
        prepare([str(tmp_path / "*.jsonl")], str(tmp_path / "out"), "byte", workers=1)
    with pytest.raises(ValueError, match=r"input '.*nope.txt': no such file or directory"):
        prepare([str(tmp_path / "nope.txt")], str(tmp_path / "out"), "byte", workers=1)
    with pytest.raises(ValueError, match="neither 'byte' nor an existing file"):
        prepare([str(tmp_path)], str(tmp_path / "out"), "nope-tokenizer", workers=1)
    assert main([str(tmp_path / "nope.txt"), "--output", str(tmp_path / "o"),
                 "--tokenizer", "byte"]) == 2


@pytest.mark.slow  # ~13 s: each spawned worker imports tfjax (and jax)
def test_the_command_line_with_two_workers(tmp_path, corpus):
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tfjax.data.prepare", str(corpus), "--output", str(out),
           "--tokenizer", "byte", "--workers", "2", "--shard_mb", str(TINY_MB * 20), "--progress"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "documents" in run.stderr and "tokens" in run.stderr
    prepare([str(corpus)], str(tmp_path / "one"), "byte", workers=1, shard_mb=TINY_MB * 20)
    assert _tree(out) == _tree(tmp_path / "one")  # the same bytes, however many workers


def test_a_tokenizer_without_an_end_of_text_token_names_the_flag(tmp_path, corpus):
    path = _bpe(tmp_path / "tok.json")
    os.remove(tmp_path / "tokenizer_config.json")
    with pytest.raises(ValueError, match=r"^--tokenizer: .*tok.json' declares no end-of-text "
                                         r"token .*add \"eos_token\""):
        prepare([str(corpus)], str(tmp_path / "out"), path, workers=1)
