"""The passkey retrieval task (tfjax.eval.passkey): rows of exactly the asked length
with the needle where the depth says, for the byte tokenizer and a BPE tokenizer;
scoring is the exact greedy match of the answer tokens; the table, the plot and the
command line on a tiny training run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tfjax.data.tokenizer import ByteTokenizer
from tfjax.eval import passkey as P

BYTES = ByteTokenizer()


def byte_encode(text, specials=True):
    return ([BYTES.bos_id] if specials else []) + [int(i) for i in BYTES.encode(text)]


@pytest.fixture(scope="module")
def bpe_encode():
    """A small BPE tokenizer (tokenizers, trained here) that adds BOS, as HF's do."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([P.INTRO, P.FILLER * 4, P.NEEDLE.format(key=12345), P.QUESTION],
                            trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    return (lambda text, specials=True: tok.encode(text, add_special_tokens=specials).ids), tok


def test_byte_rows_have_the_asked_length_and_the_needle_at_its_depth():
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    rows = P.build_samples(byte_encode, [300, 517], depths, 2, seed=3)
    assert len(rows) == 2 * 5 * 2
    head = len(byte_encode(P.INTRO))
    for s in rows:
        assert s.tokens.shape == (s.length,) and s.tokens.dtype == np.int32
        needle = P.NEEDLE.format(key=s.passkey)
        fixed = head + len(needle) + len(P.QUESTION) + len(P.ANSWER.format(key=s.passkey))
        assert s.needle_start == head + round(s.depth * (s.length - fixed))
        text = bytes(s.tokens[1:].tolist()).decode()
        assert text[s.needle_start - 1:].startswith(needle)
        assert text.endswith(P.QUESTION + " " + s.passkey)
        assert s.answer_start == s.length - len(" " + s.passkey)
        assert len(s.passkey) == 5 and s.passkey[0] != "0"
    first = [s for s in rows if s.depth == 0.0][0]
    last = [s for s in rows if s.depth == 1.0][0]
    assert first.needle_start == head
    needle_end = last.needle_start + len(P.NEEDLE.format(key=last.passkey))
    assert needle_end == last.length - len(P.QUESTION) - len(" " + last.passkey)


def test_rows_are_seeded():
    a = P.build_samples(byte_encode, [260], [0.5], 4, seed=1)
    b = P.build_samples(byte_encode, [260], [0.5], 4, seed=1)
    c = P.build_samples(byte_encode, [260], [0.5], 4, seed=2)
    assert [s.passkey for s in a] == [s.passkey for s in b]
    assert all((x.tokens == y.tokens).all() for x, y in zip(a, b))
    assert [s.passkey for s in a] != [s.passkey for s in c]
    assert len({s.passkey for s in a}) > 1


def test_bpe_rows_have_the_asked_length_and_the_needle_at_its_depth(bpe_encode):
    encode, tok = bpe_encode
    for s in P.build_samples(encode, [200, 331], [0.0, 0.5, 1.0], 2, seed=0, digits=7):
        assert len(s.tokens) == s.length and len(s.passkey) == 7
        needle = encode(P.NEEDLE.format(key=s.passkey), False)
        assert s.tokens[s.needle_start:s.needle_start + len(needle)].tolist() == needle
        assert tok.decode(s.tokens[s.answer_start:].tolist()).strip() == s.passkey
        assert s.tokens[0] == 1  # the tokenizer's BOS


def test_no_intro_starts_with_the_bos_alone():
    s = P.build_samples(byte_encode, [120], [0.0], 1, intro=False)[0]
    assert s.needle_start == 1
    assert bytes(s.tokens[1:5].tolist()).decode() == P.NEEDLE[:4]


@pytest.mark.bad_input
@pytest.mark.parametrize("kwargs, match", [
    (dict(lengths=[100]), r"--lengths: 100 tokens cannot hold .* \(--no-intro\)"),
    (dict(lengths=[50], intro=False), r"--lengths: 50 tokens cannot hold .*use lengths >= 1"),
    (dict(depths=[1.5]), r"--depths: 150 is not a percentage"),
    (dict(samples=0), r"--samples must be >= 1"),
    (dict(digits=0), r"--digits"),
    (dict(lengths=[]), r"--lengths and --depths"),
])
def test_bad_grid_is_one_line(kwargs, match):
    args = dict(lengths=[400], depths=[0.5], samples=1) | kwargs
    samples = args.pop("samples")
    with pytest.raises(ValueError, match=match) as e:
        P.build_samples(byte_encode, args.pop("lengths"), args.pop("depths"), samples, **args)
    assert "\n" not in str(e.value)


class PlantedScorer:
    """greedy: True everywhere except the planted (row, column) cells."""

    batch_size = 4

    def __init__(self, wrong):
        self.wrong, self.shapes = wrong, []

    def __call__(self, tokens, targets):
        self.shapes.append(tokens.shape)
        greedy = np.ones(tokens.shape, bool)
        for r, c in self.wrong:
            greedy[r, c] = False
        return np.zeros(tokens.shape, np.float32), greedy


def test_score_is_the_exact_match_of_every_answer_token():
    rows = P.build_samples(byte_encode, [300], [0.5], 4, seed=0)
    a = rows[0].answer_start
    # row 0: the last answer digit wrong; row 1: the space before the digits wrong;
    # row 2: a filler token and the question's last token wrong (not scored); row 3: right
    scorer = PlantedScorer([(0, 298), (1, a - 1), (2, 150), (2, a - 2)])
    assert P.score(scorer, rows, multiple=16).tolist() == [False, False, True, True]
    assert scorer.shapes == [(4, 304)]  # 299 input tokens padded to a multiple of 16


def test_table_counts_each_cell():
    rows = P.build_samples(byte_encode, [260, 300], [0.0, 1.0], 2, seed=0)
    right = np.array([s.length == 300 and s.depth == 0.0 for s in rows])
    right[0] = True  # one of the two (260, 0%) rows
    t = P.accuracy_table(rows, right)
    assert t["lengths"] == [260, 300] and t["depths"] == [0.0, 100.0]
    assert t["accuracy"] == [[0.5, 0.0], [1.0, 0.0]] and t["count"] == [[2, 2], [2, 2]]
    assert t["mean"] == 3 / 8
    text = P.format_table(t)
    assert "100%" in text and "0.50" in text and "mean accuracy 0.375" in text


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    P.plot(dict(lengths=[128, 256], depths=[0.0, 50.0, 100.0],
                accuracy=[[1.0, 0.5, 0.0], [0.0, 0.0, 1.0]]), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_on_a_training_run(run_dir, tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    argv = ["--workdir", run_dir, "--lengths", "112,128", "--depths", "0,100", "--samples",
            "2", "--no-intro", "--batch_size", "3", "--output", str(out), "--no-progress"]
    assert P.main(argv + ["--plot", str(png)]) == 0
    got = json.loads(out.read_text())
    assert got["lengths"] == [112, 128] and got["depths"] == [0.0, 100.0]
    assert got["count"] == [[2, 2], [2, 2]] and got["step"] == 3
    assert all(0.0 <= a <= 1.0 for row in got["accuracy"] for a in row)
    assert png.exists() and "length \\ depth" in capsys.readouterr().out
    assert P.main(argv) == 0 and json.loads(out.read_text())["accuracy"] == got["accuracy"]


@pytest.mark.bad_input
def test_cli_bad_input_is_one_line(run_dir, tmp_path, capsys):
    assert P.main(["--workdir", run_dir, "--lengths", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --lengths: 64 tokens cannot hold") and "\n" not in err
    assert P.main(["--workdir", run_dir, "--depths", "a", "--no-progress"]) == 2
    assert "--depths: 'a' is not comma-separated integers" in capsys.readouterr().err
    assert P.main(["--workdir", str(tmp_path / "nope"), "--no-progress"]) == 2
    assert "--workdir" in capsys.readouterr().err
