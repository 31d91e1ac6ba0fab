"""The reward registry (`tfjax.train.rl.rewards`): exact match of a final answer, a
format regex, unit tests on generated code in a subprocess with a time limit (a
failure, a crash or a timeout scores 0, the caller's process untouched), and
`score`'s one-line errors for an unknown name, a function that raises and one that
returns a non-number. And the built-in tasks (`tasks`)."""

from __future__ import annotations

import os
import time

import pytest

from tfjax.train.rl.rewards import REWARDS, final_answer, run_python, score
from tfjax.train.rl.tasks import TASKS, examples


@pytest.mark.parametrize("text,want", [("7", "7"), ("  12 \n", "12"), ("so\nthe sum is\n 9\n", "9"),
                                       ("steps... #### 42", "42"), ("", ""), ("\n\n", "")])
def test_final_answer(text, want):
    assert final_answer(text) == want


def test_exact_match_and_format():
    em, fmt = REWARDS.get("exact_match"), REWARDS.get("format")
    ex = dict(answer="7", format=r"\d+")
    assert em("3+4=", "7", ex) == 1.0
    assert em("3+4=", "thinking\n7", ex) == 1.0
    assert em("3+4=", "77", ex) == 0.0
    assert em("3+4=", "", ex) == 0.0
    assert fmt("3+4=", "77", ex) == 1.0
    assert fmt("3+4=", "7a", ex) == 0.0
    assert fmt("3+4=", "", ex) == 0.0


def test_unit_tests_pass_fail_crash():
    ut = REWARDS.get("unit_tests")
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    assert ut("", "def add(a, b):\n    return a + b", dict(tests=tests)) == 1.0
    assert ut("", "def add(a, b):\n    return a - b", dict(tests=tests)) == 0.0
    assert ut("", "def add(a, b) return", dict(tests=tests)) == 0.0  # a syntax error
    assert ut("", "import os\nos.abort()", dict(tests=tests)) == 0.0  # killed by a signal
    assert ut("", "raise SystemExit(3)", dict(tests=tests)) == 0.0


def test_unit_tests_run_in_another_process_and_time_out(tmp_path):
    ut = REWARDS.get("unit_tests")
    me = os.getpid()
    assert ut("", f"import os\nassert os.getpid() != {me}", dict(tests="")) == 1.0
    start = time.perf_counter()
    assert ut("", "while True:\n    pass", dict(tests="", timeout=1.0)) == 0.0
    assert time.perf_counter() - start < 10
    # a child whose grandchild would write a file after 2 s: the whole group is killed
    mark = tmp_path / "survived"
    code = (f"import os, time\nif os.fork() == 0:\n    time.sleep(2)\n"
            f"    open({str(mark)!r}, 'w').close()\nelse:\n    os.wait()")
    start = time.perf_counter()
    assert not run_python(code, 0.5)
    assert time.perf_counter() - start < 10
    time.sleep(2.5)
    assert not mark.exists()


def test_crashing_code_scores_zero_through_score():
    """What the loop calls: a completion whose code crashes (or never ends) is reward
    0, the others are scored, and nothing is raised."""
    exs = [dict(tests="assert add(2, 3) == 5", timeout=1.0)] * 4
    codes = ["def add(a, b):\n    return a + b", "import os\nos.abort()", "raise MemoryError",
             "while True:\n    pass"]
    total, means = score(("unit_tests",), (), [""] * 4, codes, exs)
    assert total == [1.0, 0.0, 0.0, 0.0] and means == {"unit_tests": 0.25}


def test_score_weights_and_means():
    exs = [dict(answer="7", format=r"\d+")] * 3
    total, means = score(("exact_match", "format"), (1.0, 0.5), ["3+4="] * 3, ["7", "8", "x"], exs)
    assert total == [1.5, 0.5, 0.0]
    assert means == {"exact_match": pytest.approx(1 / 3), "format": pytest.approx(2 / 3)}
    total, _ = score(("exact_match",), (), ["3+4="], ["7"], exs[:1])
    assert total == [1.0]


def test_score_errors_are_one_line():
    exs = [dict(answer="7")]
    with pytest.raises(ValueError, match=r"unknown train.grpo.reward_funcs='nope'; allowed:.*"
                                         r"exact_match") as e:
        score(("nope",), (), ["p"], ["7"], exs)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="reward function 'format' raised KeyError") as e:
        score(("format",), (), ["p"], ["7"], exs)  # the example has no "format"
    assert "\n" not in str(e.value)
    REWARDS.register("test_not_a_number", lambda p, c, ex: "1")
    REWARDS.register("test_nan", lambda p, c, ex: float("nan"))
    try:
        with pytest.raises(ValueError, match="'test_not_a_number' returned '1' on completion 0"):
            score(("test_not_a_number",), (), ["p"], ["7"], exs)
        with pytest.raises(ValueError, match="'test_nan' returned nan"):
            score(("test_nan",), (), ["p"], ["7"], exs)
    finally:
        REWARDS._items.pop("test_not_a_number")
        REWARDS._items.pop("test_nan")


@pytest.mark.parametrize("task", ["add", "sort", "copy"])
def test_tasks_are_seeded_and_verifiable(task):
    a, b = examples(task, 5, seed=3, task_max=4), examples(task, 5, seed=3, task_max=4)
    assert a == b and a != examples(task, 5, seed=4, task_max=4)
    for ex in a:
        assert REWARDS.get("exact_match")(ex["prompt"], ex["answer"], ex) == 1.0
        assert REWARDS.get("format")(ex["prompt"], ex["answer"], ex) == 1.0
    if task == "add":
        assert all(eval(ex["prompt"][:-1]) == int(ex["answer"]) for ex in a)  # noqa: S307
    if task == "sort":
        assert all(sorted(ex["prompt"][:-1]) == list(ex["answer"]) for ex in a)


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown train.grpo.task='mul'; allowed: add, copy, sort"):
        examples("mul", 1, 0, 9)
    assert set(TASKS) == {"add", "copy", "sort"}
