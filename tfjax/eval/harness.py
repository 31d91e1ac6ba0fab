"""An lm-eval-harness backend: tfjax models as lm-eval's `tfjax` model.

    python -m tfjax.eval.harness --model tfjax --model_args path=DIR --tasks hellaswag ...
    lm_eval.simple_evaluate(model="tfjax", model_args="path=DIR", tasks=[...])  # after
                                                      # `import tfjax.eval.harness`

Needs the `eval` extra (lm_eval). Importing this module registers `TfjaxLM` as lm-eval's
`tfjax` model; `python -m tfjax.eval.harness` is lm-eval's command line with it
registered (the bare `lm_eval` script does not see it). `--model_args`: `path=`, `step=`,
`max_length=`, `max_gen_toks=`, `mesh=`, `add_bos_token=`; the requests follow
lm-eval's `hf` backend, so a checkpoint scores the same. See docs/evaluation.md.
"""

from __future__ import annotations

from tfjax.eval.tasks import lm_eval_model, task_manager, training_evaluator

__all__ = ["TfjaxLM", "main", "task_manager", "training_evaluator"]

TfjaxLM = lm_eval_model()  # imports lm_eval; registered as lm-eval's `tfjax` model


def main() -> None:
    """lm-eval's command line (`lm_eval ...`) with the `tfjax` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
