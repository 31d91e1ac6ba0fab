"""lm-eval-harness' `tfjax` model (`tfjax.eval.harness`) scores what lm-eval's own `hf`
backend scores on the same tiny checkpoint, offline, on local tasks (tests/eval/data:
a jsonl dataset and task YAMLs): multiple choice (loglikelihood, one prompt longer
than the context), rolling perplexity (documents longer than the context) and
generation until a stop sequence."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install 'tfjax[eval]' "
                    "(the eval extra; `make test` installs it)")

TASKS = ["tfjax_tiny_mc", "tfjax_tiny_rolling", "tfjax_tiny_gen"]


def _evaluate(model: str, model_args: str, task_dir: str, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=task_dir, include_defaults=False)  # only ours: fast
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                   task_manager=tasks, batch_size=batch_size, device="cpu",
                                   log_samples=True)


def test_tfjax_backend_equals_lm_evals_hf_backend(hf_dir, task_dir):
    import tfjax.eval.harness  # noqa: F401 -- registers "tfjax"

    path, _ = hf_dir
    ours = _evaluate("tfjax", f"path={path}", task_dir, batch_size=4)
    theirs = _evaluate("hf", f"pretrained={path},dtype=float32", task_dir, batch_size=2)
    for task in TASKS:
        a, b = ours["samples"][task], theirs["samples"][task]
        assert len(a) == len(b) == 5
        for x, y in zip(a, b):
            assert x["doc_id"] == y["doc_id"]
            if task == "tfjax_tiny_gen":
                assert x["resps"] == y["resps"], (x["doc"], x["resps"], y["resps"])
                continue
            # loglikelihood: [[(logp, is_greedy)] per choice]; rolling: [[logp]]
            lx = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0]
                           for r in x["resps"]], np.float64)
            ly = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0]
                           for r in y["resps"]], np.float64)
            np.testing.assert_allclose(lx, ly, rtol=1e-4, err_msg=f"{task} {x['doc']}")
            if task == "tfjax_tiny_mc":
                assert [r[0][1] for r in x["resps"]] == [r[0][1] for r in y["resps"]]
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float):
                np.testing.assert_allclose(ours["results"][task][metric], value, rtol=1e-4,
                                           err_msg=f"{task} {metric}")


def test_command_line_registers_tfjax(hf_dir, task_dir, tmp_path, monkeypatch, capsys):
    """`python -m tfjax.eval.harness` is lm-eval's command line with `tfjax` known."""
    from tfjax.eval.harness import main

    path, _ = hf_dir
    out = tmp_path / "results"
    monkeypatch.setattr(sys, "argv", [
        "tfjax.eval.harness", "--model", "tfjax", "--model_args", f"path={path},mesh=data=2",
        "--tasks", "tfjax_tiny_mc", "--include_path", task_dir, "--limit", "2",
        "--batch_size", "2", "--output_path", str(out)])
    main()
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1 and "acc,none" in results[0]["results"]["tfjax_tiny_mc"]


def test_a_training_run_directory(run_dir):
    """`path=` a tfjax workdir: its checkpoint and byte tokenizer ([bos] + bytes); the
    continuation's log-probability is the restored model's, by its logits."""
    import jax
    import jax.numpy as jnp
    from lm_eval.api.instance import Instance

    from tfjax.eval.harness import TfjaxLM
    from tfjax.train.checkpoint import load_run

    wd = run_dir
    lm = TfjaxLM(path=wd, batch_size=2, mesh="data=1")
    assert lm.src.step == 3 and lm.max_length == 32
    reqs = [Instance("loglikelihood", {}, ("def add(a,", " b):"), 0),
            Instance("loglikelihood", {}, ("return", " a + b"), 0)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    model, _, tok, _ = load_run(wd)
    for (ctx, cont), (logp, _) in zip([r.args for r in reqs], got):
        ids = np.array([tok.bos_id, *tok.encode(ctx + cont)])
        logits = jax.nn.log_softmax(model(jnp.asarray(ids[None, :-1]))[0].astype(jnp.float32))
        n = len(cont.encode())
        want = float(jnp.take_along_axis(logits, jnp.asarray(ids[1:, None]), -1)[-n:].sum())
        np.testing.assert_allclose(logp, want, rtol=1e-5)
    # is_greedy: the continuation is the argmax token (ids, as lm-eval hands them over)
    ctx = [tok.bos_id, *tok.encode("def add(")]
    best = int(jnp.argmax(model(jnp.asarray([ctx]))[0, -1]))
    flags = [g for _, g in lm._loglikelihood_tokens(
        [(None, ctx, [best]), (None, ctx, [(best + 1) % 259]), (None, ctx, [best, best])],
        disable_tqdm=True)]
    assert flags[:2] == [True, False]
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("x" * 70,), 0)],
                                       disable_tqdm=True)
    assert len(rolling) == 1 and rolling[0] < 0
