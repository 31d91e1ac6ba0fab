"""Built-in verifiable prompt tasks for RL (`TASKS`): each draws examples {prompt,
answer, format} from a seeded numpy generator. add ("3+4=" -> "7"), sort ("3142:" ->
"1234") and copy ("3142:" -> "3142"), digits up to `task_max`. See docs/training.md
("Reinforcement learning: GRPO and GSPO")."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tfjax.registry import Registry

__all__ = ["TASKS", "examples"]

TASKS: Registry[Callable[[np.random.Generator, int], dict]] = Registry("RL task")


@TASKS.register("add")
def add(rng: np.random.Generator, task_max: int) -> dict:
    a, b = (int(x) for x in rng.integers(0, task_max + 1, size=2))
    return dict(prompt=f"{a}+{b}=", answer=str(a + b), format=r"\d+")


@TASKS.register("sort")
def sort(rng: np.random.Generator, task_max: int) -> dict:
    digits = rng.integers(0, 10, size=max(2, min(task_max, 8)))
    return dict(prompt="".join(map(str, digits)) + ":",
                answer="".join(map(str, sorted(digits))), format=r"\d+")


@TASKS.register("copy")
def copy(rng: np.random.Generator, task_max: int) -> dict:
    digits = rng.integers(0, 10, size=max(1, min(task_max, 8)))
    text = "".join(map(str, digits))
    return dict(prompt=text + ":", answer=text, format=r"\d+")


def examples(task: str, n: int, seed: int, task_max: int,
             field: str = "train.grpo.task") -> list[dict]:
    """`n` examples of `task` drawn from `seed` (the same seed, the same examples)."""
    fn = TASKS.get(task, field=field)
    rng = np.random.default_rng(seed)
    return [fn(rng, task_max) for _ in range(n)]
