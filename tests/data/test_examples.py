"""Examples (`tfjax.data.objectives.read_examples`) from every input kind the data layer
reads: the same preference pairs as jsonl, a .json list, parquet (local, a glob, a
bucket) and a saved Hugging Face dataset give the same batches; classification from
parquet; the split rule by record names; bad records and missing columns one line
naming the file, the line or row, and the field or column."""

import json

import numpy as np
import pytest

from tfjax import config as C
from tfjax.data.inputs import find_inputs, read_records
from tfjax.data.objectives import read_examples
from tfjax.data.pairs import encode_pairs, pair_batches, pair_examples
from tfjax.data.sources import is_validation
from tfjax.data.tokenizer import ByteTokenizer
from tfjax.train.objectives import OBJECTIVES

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TOK = ByteTokenizer()
WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pixel")
PAIRS = [dict(prompt=f"copy {w}:", chosen=f" {w}", rejected=f" {WORDS[(i + 3) % len(WORDS)]}")
         for i, w in enumerate(WORDS * 3)]
FIELDS = ("prompt", "chosen", "rejected")


def cfg_of(paths, val_paths=(), **sections):
    return C.from_dict(C.RunConfig, dict(data=dict(source="jsonl", paths=tuple(paths),
                                                   val_paths=tuple(val_paths)), **sections))


def columns(records, names):
    return {n: [r.get(n) for r in records] for n in names}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_parquet(path, records, names=FIELDS, row_group_size=None):
    pq.write_table(pa.table(columns(records, names)), path, row_group_size=row_group_size)
    return str(path)


def batches(cfg, n=3):
    enc = encode_pairs(pair_examples(cfg, "train"), TOK, 64)
    it = pair_batches(enc, TOK, seq_len=64, global_batch=2, seed=1)
    return [next(it) for _ in range(n)]


def assert_same_batches(a, b):
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_the_same_pairs_from_every_kind_give_the_same_batches(tmp_path):
    datasets = pytest.importorskip("datasets")
    val = write_jsonl(tmp_path / "val.jsonl", PAIRS[:2])
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    (tmp_path / "pairs.json").write_text(json.dumps(PAIRS))
    # several row groups: rows are numbered across them
    parquet = write_parquet(tmp_path / "pairs.parquet", PAIRS, row_group_size=5)
    (tmp_path / "shards").mkdir()
    write_parquet(tmp_path / "shards" / "a.parquet", PAIRS[:10])
    write_parquet(tmp_path / "shards" / "b.parquet", PAIRS[10:])
    datasets.Dataset.from_dict(columns(PAIRS, FIELDS)).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns(PAIRS, FIELDS)),
                          "test": datasets.Dataset.from_dict(columns(PAIRS[:1], FIELDS))}
                         ).save_to_disk(str(tmp_path / "dd"))
    want = batches(cfg_of([jsonl], [val]))
    for paths in ([str(tmp_path / "pairs.json")], [parquet], [str(tmp_path / "shards/*.parquet")],
                  [str(tmp_path / "shards")], [str(tmp_path / "ds")], [str(tmp_path / "dd")],
                  [str(tmp_path / "dd" / "train")]):
        assert_same_batches(batches(cfg_of(paths, [val])), want)
    got = pair_examples(cfg_of([parquet], [val]), "train")
    assert [{k: e[k] for k in FIELDS} for e in got] == PAIRS
    assert got[7]["where"] == f"{parquet}: row 7 (0-based)"  # for later errors about it
    assert pair_examples(cfg_of([parquet], [parquet]), "validation") == got  # val_paths: all


def test_the_split_rule_names_rows_as_prepare_names_them(tmp_path):
    """Rows are named "<file>:<0-based row>" across batches of reading (over 1024 rows)."""
    datasets = pytest.importorskip("datasets")
    n = 1500
    many = [dict(prompt=f"p{i}", chosen="c", rejected="r") for i in range(n)]
    parquet = write_parquet(tmp_path / "many.parquet", many, row_group_size=700)
    datasets.Dataset.from_dict(columns(many, FIELDS)).save_to_disk(str(tmp_path / "many"))
    for path, name in ((parquet, "many.parquet"), (str(tmp_path / "many"), "many")):
        records = list(read_records(find_inputs([path])[0], FIELDS))
        assert [r[0] for r in records] == [f"{name}:{i}" for i in range(n)]
        assert [r[2]["prompt"] for r in records] == [f"p{i}" for i in range(n)]
        val = [i for i in range(n) if is_validation(f"{name}:{i}")]
        assert 0 < len(val) < 60
        cfg = cfg_of([path])
        assert [e["prompt"] for e in pair_examples(cfg, "validation")] == [f"p{i}" for i in val]
        assert len(pair_examples(cfg, "train")) == n - len(val)


def test_classification_from_parquet(tmp_path):
    rows = [dict(text=f"{'yes' if i % 2 else 'no'} {WORDS[i % 8]}", label=i % 2)
            for i in range(20)]
    parquet = write_parquet(tmp_path / "cls.parquet", rows, ("text", "label"))
    jsonl = write_jsonl(tmp_path / "cls.jsonl", rows)
    obj = OBJECTIVES.get("classification")

    def first_batch(path):
        cfg = cfg_of([path], [path], model=dict(arch="encoder", num_classes=2),
                     train=dict(objective="classification", batch_size=4, seq_len=16))
        examples = obj.source(cfg, "train")
        return next(obj.batches(cfg, TOK, examples, None, True))

    got, want = first_batch(parquet), first_batch(jsonl)
    assert set(got) == {"inputs", "segment_ids", "positions", "labels", "mask"}
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    bad = write_parquet(tmp_path / "bad.parquet", rows[:1] + [dict(text="x", label=2)],
                        ("text", "label"))
    cfg = cfg_of([bad], [bad], model=dict(arch="encoder", num_classes=2))
    with pytest.raises(ValueError, match=r"^.*bad\.parquet: row 1 \(0-based\): field 'label' must "
                                         r"be an integer class in \[0, 2\) .*got 2$"):
        obj.source(cfg, "train")


BAD = [  # (records, the columns written, the message after the file's name)
    (PAIRS[:2], ("prompt", "chosen"),
     r": no column 'rejected'; its columns: prompt, chosen; these examples need columns prompt, "
     r"chosen, rejected: rename the column or point data.paths elsewhere$"),
    (PAIRS[:1] + [dict(PAIRS[1], chosen=None)], FIELDS,
     r": row 1 \(0-based\): field 'chosen' must be a non-empty string, got None$"),
    (PAIRS[:1] + [dict(PAIRS[1], rejected="  ")], FIELDS,
     r": row 1 \(0-based\): field 'rejected' must be a non-empty string, got '  '$"),
]


@pytest.mark.parametrize("records,names,message", BAD, ids=["no column", "null", "blank"])
def test_bad_parquet_pairs_are_one_line_naming_the_file_and_field(tmp_path, records, names,
                                                                  message):
    bad = write_parquet(tmp_path / "bad.parquet", records, names)
    with pytest.raises(ValueError, match="^" + str(tmp_path / "bad.parquet").replace(".", r"\.")
                       + message) as e:
        pair_examples(cfg_of([bad], [bad]), "train")
    assert "\n" not in str(e.value)


def test_bad_inputs_of_other_kinds(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(columns(PAIRS[:2], ("prompt", "chosen"))).save_to_disk(
        str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=r"ds: no column 'rejected'; its columns: prompt, "
                                         r"chosen; these examples need columns"):
        pair_examples(cfg_of([str(tmp_path / "ds")], [str(tmp_path / "ds")]), "train")
    (tmp_path / "list.json").write_text(json.dumps([PAIRS[0], ["not", "an", "object"]]))
    with pytest.raises(ValueError, match=r"list\.json: item 1 \(0-based\): expected a JSON object "
                                         r"with fields prompt, chosen, rejected$"):
        pair_examples(cfg_of([str(tmp_path / "list.json")], [str(tmp_path / "list.json")]),
                      "train")
    (tmp_path / "broken.jsonl").write_text(json.dumps(PAIRS[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not a JSON line"):
        pair_examples(cfg_of([str(tmp_path / "broken.jsonl")], [str(tmp_path / "broken.jsonl")]),
                      "train")
    with pytest.raises(ValueError, match=r"data\.paths: .*nothing\*\.parquet.* matches no file"):
        pair_examples(cfg_of([str(tmp_path / "nothing*.parquet")]), "train")
    only = write_parquet(tmp_path / "one.parquet", PAIRS[:1])
    with pytest.raises(ValueError, match=r"the validation split has no examples"):
        pair_examples(cfg_of([only]), "validation")
    with pytest.raises(ValueError, match=r"^data\.source: 'text'; this objective reads examples "
                                         r"with fields a, b from jsonl, parquet or Hugging Face"):
        read_examples(C.DataConfig(source="text", paths=(only,)), "train",
                      {"a": "text", "b": "text"})


def test_parquet_pairs_on_a_bucket_read_as_the_local_file(tmp_path, gcs_bucket):
    pytest.importorskip("gcsfs")
    from etils import epath

    local = write_parquet(tmp_path / "pairs.parquet", PAIRS)
    epath.Path(f"{gcs_bucket}/data/pairs.parquet").write_bytes(open(local, "rb").read())
    remote = pair_examples(cfg_of([f"{gcs_bucket}/data/*.parquet"]), "train")
    assert [{k: e[k] for k in FIELDS} for e in remote] == [
        {k: e[k] for k in FIELDS} for e in pair_examples(cfg_of([local]), "train")]
