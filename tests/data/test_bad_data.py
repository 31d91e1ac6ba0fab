"""Bad data files are one-line ValueErrors naming the file (and line / field) and the
fix, raised when the source is built (never mid-training), and the trainer's report
never compares against zero bytes."""

import json
import re

import jax
import numpy as np
import pytest

from tfjax import config as C
from tfjax.config import DataConfig
from tfjax.data import documents, is_validation
from tfjax.train import Trainer
from tfjax.train.metrics import compression_bits_per_byte, compression_report

pytestmark = pytest.mark.bad_input


def _write(path, content: bytes):
    path.write_bytes(content)
    return str(path)


def _jsonl(*lines) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


# (source, file name, content, split, regex the message must match; {path} = the file)
EMPTY = [
    ("text", "empty.txt", b"", "train",
     r"data.paths: the train split is empty: .*1 empty or whitespace only \({path}\)"),
    ("text", "blank.txt", b" \n\t\n  ", "train",
     r"data.paths: the train split is empty: .*1 empty or whitespace only \({path}\)"),
    ("jsonl", "empty.jsonl", b"", "train",
     r"data.paths: the train split is empty: .*0 line\(s\) of this split in {path}"),
    ("jsonl", "blank.jsonl", b"\n   \n", "train",
     r"data.paths: the train split is empty: .*in {path}: 2 blank"),
    ("jsonl", "hollow.jsonl", _jsonl({"text": ""}, {"text": " \n "}, {"text": "\t"}), "train",
     r"data.paths: the train split is empty: .*in {path}: 0 blank, 3 whose 'text' "
     r"\(data.jsonl_field\) is empty or whitespace only"),
]


@pytest.mark.parametrize("source,name,content,split,message", EMPTY,
                         ids=[e[1] for e in EMPTY])
def test_empty_split_names_the_files(tmp_path, source, name, content, split, message):
    path = _write(tmp_path / name, content)
    with pytest.raises(ValueError, match=message.format(path=re.escape(path))) as e:
        documents(DataConfig(source=source, paths=(path,)), split)
    assert "\n" not in str(e.value)


def _bad_line(name: str, split: str) -> int:
    """A 1-based line number of `name` whose line goes to `split` by the sha1 rule."""
    return next(n for n in range(1, 1000)
                if is_validation(f"{name}:{n - 1}") == (split == "validation"))


# (bad line, regex after "{path}:{line}: ")
BAD_LINES = [
    (b'{"content": "x", "id": 3}',
     r"the record has no field 'text' \(data.jsonl_field\); its fields: content, id; set "
     r"data.jsonl_field .*--config.data.jsonl_field=content"),
    (b'{"id": 3}', r"the record has no field 'text' .*set data.jsonl_field=\.\.\."),
    (b"plain text, not json", r"not a JSON line \(Expecting value at column 1\); "
     r"data.source='jsonl' reads one JSON object per line"),
    (b'{"text": "unterminated', r"not a JSON line"),
    (b'{"text": "\xff"}', r"not a JSON line .*utf-8"),
    (b'["text", "x"]', r"the line is a list, not a JSON object with field 'text'"),
    (b'{"text": ["a", "b"]}', r"field 'text' \(data.jsonl_field\) is a list, not a string; "
     r"point data.jsonl_field=\.\.\."),
    (b'{"text": 42}', r"field 'text' \(data.jsonl_field\) is a number, not a string"),
    (b'{"text": null}', r"field 'text' \(data.jsonl_field\) is null, not a string"),
]


@pytest.mark.parametrize("split_of_bad_line", ["train", "validation"])
@pytest.mark.parametrize("line,message", BAD_LINES, ids=[str(b[0])[:24] for b in BAD_LINES])
def test_bad_jsonl_line_names_file_line_and_field(tmp_path, line, message, split_of_bad_line):
    """Checked when either split is built, whichever split the bad line goes to."""
    n = _bad_line("d.jsonl", split_of_bad_line)
    good = [_jsonl({"text": f"record {i}"}).rstrip(b"\n") for i in range(n + 5)]
    good[n - 1] = line
    path = _write(tmp_path / "d.jsonl", b"\n".join(good) + b"\n")
    for split in ("train", "validation"):
        with pytest.raises(ValueError, match=f"^{re.escape(path)}:{n}: {message}") as e:
            documents(DataConfig(source="jsonl", paths=(str(tmp_path / "*.jsonl"),)), split)
        assert "\n" not in str(e.value)


def test_another_jsonl_field(tmp_path):
    path = _write(tmp_path / "d.jsonl", _jsonl({"content": "abc"}, {"content": "de"}))
    docs = documents(DataConfig(source="jsonl", paths=(path,), val_paths=(path,),
                                jsonl_field="content"), "train")
    assert [docs[i] for i in range(len(docs))] == [b"abc", b"de"]


def test_empty_documents_are_skipped(tmp_path):
    """Among documents with text, empty ones are dropped rather than trained on as
    BOS/EOS alone."""
    for name, text in (("a.txt", "alpha"), ("b.txt", ""), ("c.txt", "  \n"), ("d.txt", "delta")):
        (tmp_path / name).write_text(text)
    files = tuple(str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt", "d.txt"))
    docs = documents(DataConfig(source="text", paths=files, val_paths=files[:1]), "train")
    assert [docs[i] for i in range(len(docs))] == [b"alpha", b"delta"]
    path = _write(tmp_path / "d.jsonl", _jsonl({"text": "x"}, {"text": ""}, {"text": " "}) +
                  b"\n" + _jsonl({"text": "y"}))
    docs = documents(DataConfig(source="jsonl", paths=(path,), val_paths=(path,)), "train")
    assert [docs[i] for i in range(len(docs))] == [b"x", b"y"]


def test_trainer_refuses_an_empty_data_file_before_compiling(tmp_path):
    path = _write(tmp_path / "empty.txt", b"\n\n")
    cfg = C.from_dict(C.RunConfig, dict(
        model=dict(vocab_size=259, d_model=32, num_heads=4, d_ff=64, num_layers=1),
        train=dict(steps=1, batch_size=1, seq_len=16, progress=False),
        data=dict(source="text", paths=(path,), val_paths=(path,)),
        checkpoint=dict(enabled=False)))
    with pytest.raises(ValueError, match=f"data.paths: the train split is empty: .*"
                                         f"{re.escape(path)}"):
        Trainer(cfg, str(tmp_path / "w"), devices=jax.devices()[:1], log=lambda s: None)


def test_compression_report_never_compares_against_zero_bytes():
    entries, line = compression_report(0.5, b"")
    assert entries == {} and "beat" not in line and "no validation bytes" in line
    with pytest.raises(ValueError, match="no bytes"):
        compression_bits_per_byte(b"")
    entries, line = compression_report(0.5, b"def f(x):\n    return x\n" * 20)
    assert set(entries) == {"gzip_bpb", "xz_bpb"} and "tfjax beats gzip and xz" in line
    assert "tfjax beats neither gzip nor xz" in compression_report(1000.0, b"abc")[1]
    short = b"def f(x):\n    return x\n" * 20  # gzip 0.82 bits/byte, xz 1.67 (its header)
    assert "tfjax beats xz, not gzip" in compression_report(1.0, short)[1]
    block = np.random.default_rng(0).bytes(40_000)  # repeated past gzip's 32 KiB window
    base = compression_bits_per_byte(block * 2)
    assert base["xz"] < 5.0 < base["gzip"], base
    assert "tfjax beats gzip, not xz" in compression_report(5.0, block * 2)[1]
