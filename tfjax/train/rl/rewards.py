"""Reward functions for RL (`REWARDS`, a `tfjax.registry.Registry`): each maps
(prompt, completion, example) to a float. exact_match (the final answer against
example["answer"]), format (the completion against the regex example["format"]),
unit_tests (the completion as Python, then example["tests"], in a subprocess with a
time limit: a failure, a crash or a timeout scores 0). `score` sums them with weights
and turns a function that raises or returns a non-number into one line naming it.
See docs/training.md ("Reinforcement learning: GRPO and GSPO")."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from tfjax.registry import Registry

__all__ = ["REWARDS", "final_answer", "run_python", "score"]

REWARDS: Registry[Callable[..., float]] = Registry("reward function")


def final_answer(completion: str) -> str:
    """The answer a completion ends with: the text after its last "####" if it has
    one (GSM8K's mark), else its last non-empty line, stripped."""
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip()
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@REWARDS.register("exact_match")
def exact_match(prompt: str, completion: str, example: dict) -> float:
    return float(final_answer(completion) == str(example["answer"]).strip())


@REWARDS.register("format")
def format_match(prompt: str, completion: str, example: dict) -> float:
    return float(re.fullmatch(example["format"], completion.strip()) is not None)


def run_python(code: str, timeout: float) -> bool:
    """Whether `code` runs to exit status 0 in a fresh, isolated interpreter (`python
    -I`, a scratch working directory) within `timeout` seconds; on a timeout its
    whole process group is killed. Never runs in this process."""
    with tempfile.TemporaryDirectory(prefix="tfjax_reward_") as tmp:
        proc = subprocess.Popen([sys.executable, "-I", "-c", code], cwd=tmp,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False


@REWARDS.register("unit_tests")
def unit_tests(prompt: str, completion: str, example: dict) -> float:
    code = f"{completion}\n\n{example['tests']}\n"
    return float(run_python(code, float(example.get("timeout", 5.0))))


def score(names: Sequence[str], weights: Sequence[float], prompts: Sequence[str],
          completions: Sequence[str], examples: Sequence[dict],
          field: str = "train.grpo.reward_funcs") -> tuple[list[float], dict[str, float]]:
    """(the weighted sum of the named rewards per completion, each reward's mean).
    An unknown name, a function that raises or one that returns a non-number is a
    one-line ValueError naming it (and the completion)."""
    fns = [REWARDS.get(n, field=field) for n in names]
    weights = list(weights) or [1.0] * len(fns)
    total = [0.0] * len(completions)
    means = {}
    for name, fn, w in zip(names, fns, weights):
        got = []
        for i, (p, c, ex) in enumerate(zip(prompts, completions, examples)):
            try:
                r = fn(p, c, ex)
            except Exception as e:  # noqa: BLE001 -- the user's function: say which one
                raise ValueError(f"reward function {name!r} raised {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''} on completion "
                                 f"{i} ({c[:40]!r}); fix the function or its example") from e
            if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r):
                raise ValueError(f"reward function {name!r} returned {r!r} on completion {i}; "
                                 f"a reward must be a number (float)")
            got.append(float(r))
            total[i] += w * float(r)
        means[name] = sum(got) / max(len(got), 1)
    return total, means
