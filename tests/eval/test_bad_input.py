"""`python -m tfjax.eval` on bad input: one line naming the flag or file and the fix,
exit status 2, before the scoring program is built (docs/guarantees.md)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytestmark = pytest.mark.bad_input


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if the CLI gets as far as building its jitted scorer."""
    import tfjax.eval.__main__ as cli

    def refuse(*a, **k):
        raise AssertionError("the scorer was built: the error came too late")

    monkeypatch.setattr(cli, "Scorer", refuse)


def _error(capsys, argv) -> str:
    from tfjax.eval.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def _lines(tmp_path, *rows) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_missing_paths(hf_dir, tmp_path, capsys, no_compile):
    path, _ = hf_dir
    data = _lines(tmp_path, {"text": "hi"})
    assert "--data" in _error(capsys, ["--hf", path, "--data", str(tmp_path / "nope.jsonl")])
    assert "--hf" in _error(capsys, ["--hf", str(tmp_path / "nope"), "--data", data])
    assert "--workdir" in _error(capsys, ["--workdir", str(tmp_path / "nope"), "--data", data])
    assert "--output" in _error(capsys, ["--hf", path, "--data", data, "--output",
                                         str(tmp_path / "no" / "dir" / "o.json")])
    assert "config.json" in _error(capsys, ["--workdir", str(tmp_path), "--data", data])


@pytest.mark.parametrize("row,words", [
    ({"txt": "hi"}, ['"text"', '"input_ids"', "txt"]),
    ("not json", ["not JSON"]),
    ([1, 2, 3], ['"text"', "list"]),
    ({"input_ids": [1, "2"]}, ["list of integers"]),
    ({"input_ids": [1, 2, 259]}, ["259", "vocabulary [0, 259)"]),
    ({"input_ids": [-1, 2]}, ["-1"]),
])
def test_bad_lines_name_file_and_line(hf_dir, tmp_path, capsys, no_compile, row, words):
    path, _ = hf_dir
    data = _lines(tmp_path, {"text": "fine"}, row)
    err = _error(capsys, ["--hf", path, "--data", data])
    assert f"{data}:2" in err and all(w in err for w in words), err


def test_nothing_to_score_and_bad_flags(hf_dir, tmp_path, capsys, no_compile):
    path, _ = hf_dir
    assert "no lines" in _error(capsys, ["--hf", path, "--data", _lines(tmp_path, "")])
    data = _lines(tmp_path, {"text": "abc"})
    assert "--stride" in _error(capsys, ["--hf", path, "--data", data, "--stride", "33"])
    assert "--context" in _error(capsys, ["--hf", path, "--data", data, "--context", "0"])
    assert "--mesh" in _error(capsys, ["--hf", path, "--data", data, "--mesh", "dat=2"])
    assert "--step" in _error(capsys, ["--hf", path, "--data", data, "--step", "3"])


def test_a_tokenizer_that_does_not_fit_the_model(hf_dir, tmp_path, capsys, no_compile):
    import tokenizers

    path, _ = hf_dir
    bad = tmp_path / "ckpt"
    shutil.copytree(path, bad)
    tok = tokenizers.Tokenizer.from_file(str(bad / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(5)])  # 264 ids for a 259-row model
    tok.save(str(bad / "tokenizer.json"))
    err = _error(capsys, ["--hf", str(bad), "--data", _lines(tmp_path, {"text": "x"})])
    assert "264 ids" in err and "vocab_size is 259" in err and "tokenizer.json" in err, err
