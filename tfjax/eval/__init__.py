"""Evaluation: perplexity of a causal LM on a jsonl file, and an lm-eval-harness backend.

- `perplexity`: `Scorer` (per-token log-probabilities of a decoder LM, jitted, rows
  data-parallel over a mesh), `windows`, `evaluate` and `summarize` (tokens, NLL per
  token, perplexity, bits per byte).
- `loading`: `load_source` (a model, its tokenizer and context, from `--hf` or
  `--workdir`), `check_context`, and `eval_mesh` / `parse_mesh` (`--mesh`).
- `harness`: lm-eval's `tfjax` model (needs the `eval` extra; not imported here).
- `passkey`: passkey retrieval by context length and depth (`python -m tfjax.eval.passkey`).
- `python -m tfjax.eval` is the perplexity command line. See docs/evaluation.md.
"""

from tfjax.eval.loading import Source, check_context, eval_mesh, load_source, parse_mesh
from tfjax.eval.perplexity import Scorer, evaluate, summarize, windows

__all__ = ["Scorer", "Source", "check_context", "eval_mesh", "evaluate", "load_source",
           "parse_mesh", "summarize", "windows"]
