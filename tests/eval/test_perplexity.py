"""`python -m tfjax.eval`: the numbers equal a torch loop over transformers' own model
and loss on the same tokens and windows; windows score every target once; bad input
is one line before anything compiles."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")
from eval_fixtures import CONTEXT  # noqa: E402

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "héllo wörld",  # multi-byte UTF-8: bytes != characters
    "x",
    "The quick brown fox jumps over the lazy dog; " * 2,  # > CONTEXT tokens: windows
]
IDS = [5, 17, 3, 40, 200, 9, 9, 9, 1, 250, 64, 2, 7, 7, 100, 31, 8, 12, 90, 91, 92, 93, 94,
       95, 96, 97, 98, 99, 10, 11, 12, 13, 14, 15, 16]  # 35 ids: two windows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _torch_nll(model, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """(summed NLL, targets) of one sequence: windows of `context` inputs starting every
    `stride` tokens, each scoring the targets no earlier window scored, with
    transformers' own shifted loss (labels=-100 for targets already scored)."""
    total, count, begin, scored = 0.0, 0, 0, 1
    while scored < len(ids):
        chunk = torch.tensor([ids[begin:begin + context + 1]])
        labels = chunk.clone()
        labels[0, :scored - begin] = -100
        n = int((labels[0, 1:] != -100).sum())
        with torch.no_grad():
            total += float(model(input_ids=chunk, labels=labels).loss) * n
        count += n
        scored = begin + chunk.shape[1]
        begin += stride
    return total, count


@pytest.mark.parametrize("stride", [None, 12])
def test_matches_transformers_on_the_same_tokens(hf_dir, tmp_path, stride):
    from tfjax.eval.__main__ import run

    path, ref = hf_dir
    auto = transformers.AutoTokenizer.from_pretrained(path)
    data = _write(tmp_path / "val.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "out.json"
    got = run(data=data, hf=path, output=str(out), batch_size=3, stride=stride, progress=False)
    assert json.loads(out.read_text()) == got

    want, n = 0.0, 0
    for t in TEXTS:
        s, c = _torch_nll(ref, auto(t)["input_ids"], CONTEXT, stride or CONTEXT)
        want, n = want + s, n + c
    assert got["tokens"] == n == sum(len(t.encode()) for t in TEXTS)  # bytes + BOS - 1 each
    assert got["windows"] > len(TEXTS) and got["context"] == CONTEXT
    np.testing.assert_allclose(got["nll"], want / n, rtol=1e-4)
    np.testing.assert_allclose(got["perplexity"], math.exp(want / n), rtol=1e-4)
    n_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    assert got["bytes"] == n_bytes
    np.testing.assert_allclose(got["bits_per_byte"], want / math.log(2) / n_bytes, rtol=1e-4)


def test_input_ids_are_scored_as_given_and_have_no_bits_per_byte(hf_dir, tmp_path, capsys):
    from tfjax.eval.__main__ import main

    path, ref = hf_dir
    data = _write(tmp_path / "ids.jsonl", [{"input_ids": IDS}, {"text": TEXTS[0]}])
    out = tmp_path / "o.json"
    assert main(["--hf", path, "--data", data, "--output", str(out), "--no-progress",
                 "--mesh", "tensor=2", "--batch_size", "2"]) == 0
    got = json.loads(out.read_text())
    assert "bits_per_byte" not in got and f"tokens {got['tokens']:,}" in capsys.readouterr().out
    auto = transformers.AutoTokenizer.from_pretrained(path)
    s1, c1 = _torch_nll(ref, IDS, CONTEXT, CONTEXT)
    s2, c2 = _torch_nll(ref, auto(TEXTS[0])["input_ids"], CONTEXT, CONTEXT)
    assert got["tokens"] == c1 + c2 == len(IDS) - 1 + len(TEXTS[0])
    np.testing.assert_allclose(got["nll"], (s1 + s2) / (c1 + c2), rtol=1e-4)


@pytest.mark.parametrize("n,context,stride", [(2, 1, 1), (10, 4, 4), (10, 4, 1), (33, 32, 32),
                                              (100, 16, 5), (7, 16, 3)])
def test_windows_score_every_target_once_with_at_least_context_minus_stride(n, context, stride):
    from tfjax.eval import windows

    scored = []
    for i, (start, stop, first) in enumerate(windows(n, context, stride)):
        assert 0 < stop - start <= context and 0 <= first < stop - start
        targets = list(range(start + 1 + first, stop + 1))
        if i:  # every target after the first window sees >= context - stride tokens
            assert min(t - start for t in targets) >= min(context - stride, targets[0])
        scored += targets
    assert scored == list(range(1, n))


def test_workdir_scores_the_checkpoint_with_the_runs_tokenizer(run_dir, tmp_path):
    """--workdir: the latest checkpoint of a run the trainer saved, its byte tokenizer
    ([bos] + bytes), its train.seq_len as the context; the same as the trainer's
    `cross_entropy_sums` on the restored model."""
    import jax.numpy as jnp

    from tfjax.eval.__main__ import run
    from tfjax.train.checkpoint import load_run
    from tfjax.train.losses import cross_entropy_sums

    wd = run_dir
    text = "def add(a, b):\n    return a + b\n" * 2  # 66 bytes > seq_len 32: windows
    data = _write(tmp_path / "v.jsonl", [{"text": text}])
    got = run(data=data, workdir=wd, progress=False)
    assert got["step"] == 3 and got["context"] == 32 and got["tokens"] == len(text)
    model, _, tok, _ = load_run(wd)
    ids = np.array([tok.bos_id, *tok.encode(text)])
    nll = 0.0
    for start in range(0, len(ids) - 1, 32):
        chunk = ids[start:start + 33]
        s = cross_entropy_sums(model(jnp.asarray(chunk[None, :-1])), jnp.asarray(chunk[None, 1:]),
                               jnp.ones((1, len(chunk) - 1)))
        nll += float(s["nll"])
    np.testing.assert_allclose(got["nll"], nll / len(text), rtol=1e-5)
    np.testing.assert_allclose(got["bits_per_byte"], nll / math.log(2) / len(text), rtol=1e-5)
