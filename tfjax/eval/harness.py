"""An lm-eval-harness backend: tfjax models as lm-eval's `tfjax` model.

    python -m tfjax.eval.harness --model tfjax --model_args path=DIR --tasks hellaswag ...
    lm_eval.simple_evaluate(model="tfjax", model_args="path=DIR", tasks=[...])  # after
                                                      # `import tfjax.eval.harness`

Needs the `eval` extra (`pip install 'tfjax[eval]'`: lm_eval). Importing this module
registers `TfjaxLM` under the name `tfjax` in lm-eval's model registry
(`lm_eval.api.registry.register_model`, lm-eval's documented mechanism for a model
defined outside its package). lm-eval 0.4 discovers no models through package entry
points, so its own `lm_eval` console script does not see `tfjax`;
`python -m tfjax.eval.harness` is that command line with the model registered first
(every `lm_eval` argument is accepted as is).

`--model_args`: `path=DIR` (a tfjax training run directory when it holds
`checkpoints/`, else a Hugging Face checkpoint directory; or `workdir=` / `hf=`
explicitly), `step=` (a run's checkpoint), `max_length=` (default: the model's
context, `tfjax.eval.loading`), `max_gen_toks=` (256), `mesh=data=2;tensor=2` (';'
between axes: lm-eval splits model_args at ','; default data-parallel over all
devices), `add_bos_token=` (default: the tokenizer's own choice, as lm-eval's `hf`
backend). `--batch_size` is windows or prompts per step (an int; default 8).

The requests follow lm-eval's `hf` backend (`lm_eval.models.huggingface.HFLM`) so that
the same checkpoint scores the same: `loglikelihood` encodes context + continuation
together and scores the continuation's tokens (left-truncated to `max_length + 1`);
`loglikelihood_rolling` scores a document in lm-eval's disjoint rolling windows
(`lm_eval.utils.get_rolling_token_windows`); `generate_until` decodes with tfjax's
KV-cached `tfjax.inference.generate` (greedy unless `do_sample`), prompts
left-truncated to `max_length - max_gen_toks` tokens, the text cut at the first stop
sequence. Scoring is `tfjax.eval.perplexity.Scorer` (one compiled program per
power-of-two length bucket). The model is built in `tfjax.eval.tasks`, which imports
lm_eval only when used (the training hook of `train.eval_tasks` runs from there).
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
