"""`train.eval_tasks`: lm-eval tasks scored on the model being trained at each
evaluation, logged as metrics, equal to lm-eval on the saved checkpoint afterwards;
an unknown task fails before anything compiles."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from tiny_run import tiny_run_config

pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install 'tfjax[eval]'")

from tfjax import config as C  # noqa: E402
from tfjax.train.__main__ import eval_hooks  # noqa: E402
from tfjax.train.trainer import Trainer  # noqa: E402

TASKS = "tfjax_tiny_mc,tfjax_tiny_rolling"


def run_config(tmp_path, task_dir, tasks=TASKS):
    """tests/tiny_run.py's run, two steps, the tasks scored at each evaluation."""
    return tiny_run_config(tmp_path, train=dict(steps=2, lr=1e-2, eval_every=1, eval_batches=1,
                                                eval_tasks=tasks, eval_tasks_path=task_dir,
                                                eval_tasks_limit=3),
                           mesh=dict(data=1))


def test_tasks_are_scored_during_training_as_lm_eval_scores_the_checkpoint(tmp_path, task_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tfjax.eval.harness import TfjaxLM

    cfg = run_config(tmp_path, task_dir)
    wd = str(tmp_path / "w")
    summary = Trainer(cfg, wd, devices=jax.devices()[:1], log=lambda s: None,
                      eval_hooks=eval_hooks(cfg)).train()
    records = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]
    evals = [r for r in records if "lm_eval/tfjax_tiny_mc/acc" in r]
    assert [r["step"] for r in evals] == [1, 2]  # eval_every=1, and at the end
    keys = {"lm_eval/tfjax_tiny_mc/acc", "lm_eval/tfjax_tiny_mc/acc_norm",
            "lm_eval/tfjax_tiny_rolling/bits_per_byte", "lm_eval/tfjax_tiny_rolling/word_perplexity"}
    assert keys <= set(summary) and not any(k.endswith("_stderr") for k in summary)
    # the same tasks on the final checkpoint, through lm-eval's own entry point
    out = lm_eval.simple_evaluate(model=TfjaxLM(path=wd, batch_size=8, mesh="data=1"),
                                  tasks=TASKS.split(","), limit=3,
                                  task_manager=TaskManager(include_path=task_dir,
                                                           include_defaults=False))
    for key in keys:
        _, task, metric = key.split("/")
        np.testing.assert_allclose(summary[key], out["results"][task][f"{metric},none"],
                                   rtol=1e-5, err_msg=key)
    assert evals[0]["lm_eval/tfjax_tiny_rolling/bits_per_byte"] != summary[
        "lm_eval/tfjax_tiny_rolling/bits_per_byte"]  # it trained in between


def test_an_unknown_task_names_the_field(tmp_path, task_dir):
    cfg = run_config(tmp_path, task_dir, tasks="tfjax_tiny_mc,no_such_task")
    with pytest.raises(ValueError, match="train.eval_tasks: unknown lm-eval task.s. no_such_task"):
        eval_hooks(cfg)
    with pytest.raises(ValueError, match="train.eval_tasks: lm-eval tasks score a causal LM"):
        C.from_dict(C.RunConfig, dict(train=dict(eval_tasks="x", objective="mlm"))).validate()
