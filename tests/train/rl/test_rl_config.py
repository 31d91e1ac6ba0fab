"""Bad GRPO input is one line naming the field and the fix, before anything compiles:
num_generations < 2, a batch that does not divide into groups, an unknown reward or
task, completions that do not fit seq_len, a prompt longer than max_prompt_length;
and through the command line (exit status 2). `Trainer` sends "grpo" to its loop; the
KL reference is `tfjax.train.reference`'s."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs.grpo import get_config
from tfjax.config import run_config
from tfjax.data.tokenizer import load_tokenizer
from tfjax.train import OBJECTIVES, Trainer
from tfjax.train.reference import Reference
from tfjax.train.rl import GRPOTrainer, check_grpo
from tfjax.train.rl.rollout import encode_prompt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _cfg(**grpo):
    c = get_config("tiny")
    c.train.grpo.update(grpo)
    return c


@pytest.mark.parametrize("grpo,train,match", [
    (dict(num_generations=1), {}, r"train.grpo.num_generations: got 1; .* at least 2"),
    ({}, dict(batch_size=36), r"train.batch_size: 36 completions do not divide into groups of "
                              r"train.grpo.num_generations=8; use a multiple of it"),
    (dict(loss_type="ppo"), {}, r"train.grpo.loss_type: got 'ppo'; allowed: 'grpo'"),
    (dict(importance_sampling_level="seq"), {}, r"importance_sampling_level: got 'seq'"),
    (dict(scale_rewards="std"), {}, r"scale_rewards: got 'std'"),
    (dict(reward_weights=(1.0,)), {}, r"train.grpo.reward_weights: 1 weights for 2 reward_funcs"),
    (dict(temperature=0.0), {}, r"train.grpo.temperature: must be > 0"),
])
def test_config_errors(grpo, train, match):
    c = _cfg(**grpo)
    c.train.update(train)
    with pytest.raises(ValueError, match=match) as e:
        run_config(c).validate()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("grpo,train,match", [
    (dict(reward_funcs=("exact_match", "nope")), {},
     r"unknown train.grpo.reward_funcs='nope'; allowed: exact_match, format, unit_tests"),
    (dict(task="mul"), {}, r"unknown train.grpo.task='mul'"),
    (dict(max_completion_length=20), {}, r"train.seq_len: 16 < train.grpo.max_prompt_length"),
    ({}, dict(microbatches=2), r"train.microbatches: GRPO"),
    ({}, dict(objective="causal_lm"), r"train.objective: GRPOTrainer runs 'grpo'"),
])
def test_run_errors(grpo, train, match):
    c = _cfg(**grpo)
    c.train.update(train)
    with pytest.raises(ValueError, match=match) as e:
        check_grpo(run_config(c).validate())
    assert "\n" not in str(e.value)


def test_prompt_too_long():
    tok = load_tokenizer("byte")
    assert encode_prompt(tok, "3+4=", 5, "0") == [tok.bos_id, *tok.encode("3+4=")]
    with pytest.raises(ValueError, match=r"train.grpo.max_prompt_length: prompt 0 \('12\+34='\) "
                                         r"has 7 tokens with BOS, more than 5; raise it"):
        encode_prompt(tok, "12+34=", 5, "0")


@pytest.mark.parametrize("override,match", [
    ("--config.train.grpo.num_generations=1", "train.grpo.num_generations: got 1"),
    ("--config.train.grpo.reward_funcs=('exact_match','nope')", "unknown train.grpo.reward_funcs='nope'"),
    ("--config.train.batch_size=12", "train.batch_size: 12 completions do not divide"),
])
def test_command_line_errors(tmp_path, override, match):
    p = subprocess.run([sys.executable, "-m", "tfjax.train", "--config", "configs/grpo.py:tiny",
                        "--workdir", str(tmp_path), override], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and match in lines[0], p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "checkpoints")


def test_trainer_sends_grpo_to_its_loop(tmp_path):
    """"grpo" is a registered objective (its name in the lists and errors), and the
    one trainer refuses it in one line naming the loop that runs it."""
    assert "grpo" in OBJECTIVES
    with pytest.raises(ValueError, match=r"train.objective: 'grpo' .* tfjax.train.rl.GRPOTrainer"
                       ) as e:
        Trainer(run_config(_cfg()), str(tmp_path), log=lambda s: None)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("beta,lora", [(0.0, False), (0.1, False), (0.1, True)])
def test_reference_is_the_one_home(tmp_path, beta, lora):
    """GRPO's KL reference is `tfjax.train.reference`'s: state["reference"] = {params,
    rest} (a copy of the starting policy) without LoRA, the base with LoRA, none at
    beta 0."""
    c = _cfg(beta=beta)
    if lora:
        c.lora.update(dict(rank=2, targets="all"))
    trainer = GRPOTrainer(run_config(c), str(tmp_path), log=lambda s: None)
    ref, abstract = trainer.program.reference, trainer.program.abstract_state
    if not beta:
        assert ref is None and "reference" not in abstract
        return
    assert isinstance(ref, Reference) and ref.kind == "reference"
    if lora:
        assert ref.abstract is None and "reference" not in abstract
        return
    assert set(abstract["reference"]) == {"params", "rest"}
    state = trainer._fresh()
    params, rest = ref.parts(state)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"]), strict=True):
        assert x is not y
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
