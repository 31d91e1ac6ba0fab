"""The GRPO loop (`tfjax.train.rl.GRPOTrainer`) on a tiny byte-level decoder: rollouts
run on the policy's current arrays (no copy) with nothing compiled after the first
rollout batch, the engine's log-probs equal the update's, LoRA's reference is the base;
the tiny preset's reward rises (`python -m tfjax.train`, bounded in time), and
a run stopped at a checkpoint resumes exactly. All slow (the loop compiles its
programs: ~30 s each on a 2-core CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.grpo import get_config
from tfjax.config import run_config
from tfjax.inference.engine import Request
from tfjax.train.lora import model_params
from tfjax.train.rl import GRPOTrainer, completion_logps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _cfg(steps=10, sft=2, **grpo):
    c = get_config("tiny")
    c.train.update(dict(steps=steps, batch_size=16, log_every=1))
    c.train.grpo.update(dict(sft_steps=sft, **grpo))
    c.checkpoint.update(dict(enabled=False))
    return c


@pytest.mark.slow  # ~30 s: the loop's programs compile
def test_rollouts_reuse_programs_and_arrays(tmp_path):
    logged = []
    compiled = []  # (the last step logged when a backend compile happened)
    listener = lambda event, *a, **k: compiled.append(logged[-1] if logged else 0) \
        if event == "/jax/core/compile/backend_compile_duration" else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    trainer = GRPOTrainer(run_config(_cfg(steps=14, sft=2)), str(tmp_path),
                          log=lambda s: logged.append(int(s.split()[1][:-1])) if s.startswith(
                              "step ") else None)
    try:
        trainer.train()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert logged == list(range(1, 15))
    # rollout batches at steps 3, 5, ..., 13. The first compiles the engine, the
    # log-probs and the update (before step 3 is logged); after it nothing compiles,
    # also on the tests' 8-device mesh (the engine's state keeps its shardings)
    assert compiled and max(compiled) <= 2, compiled
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rl = [r for r in rows if "reward_mean" in r]
    assert len(rl) == 12 and len([r for r in rows if "sft_loss" in r]) == 2
    for key in ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_length",
                "rollout_s", "update_s", "rewards/exact_match", "rewards/format", "loss"):
        assert all(np.isfinite(r[key]) for r in rl), key
    assert rl[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference: the warmed-up policy
    assert rl[-1]["kl"] > 1e-4
    # the engine computes with the state's own arrays (no copy)
    state = trainer.state
    trainer.rollouts.set_params(model_params(trainer.program.lora, state), state["rest"])
    ours = {id(x) for x in jax.tree.leaves(state["params"])}
    theirs = {id(x) for x in jax.tree.leaves(trainer.rollouts.engine.params)}
    assert ours <= theirs


@pytest.mark.slow
def test_engine_logprobs_are_the_updates(tmp_path):
    trainer = GRPOTrainer(run_config(_cfg(steps=4, sft=3, temperature=0.7)), str(tmp_path),
                          log=lambda s: None)
    trainer.train()
    state, tok = trainer.state, trainer.tokenizer
    params = model_params(trainer.program.lora, state)
    trainer.rollouts.set_params(params, state["rest"])
    engine = trainer.rollouts.engine
    prompt = [tok.bos_id, *tok.encode("3+4=")]
    req = Request(prompt, max_tokens=3, n=4, sampling=dict(temperature=0.7, seed=5))
    engine.submit(req)
    got = {i: ([], []) for i in range(4)}
    while engine.has_work():
        for o in engine.step():
            if o.token is not None:
                got[o.index][0].append(o.token)
                got[o.index][1].append(o.logprob)
    model = nnx.merge(trainer.program.eval_graphdef, params, state["rest"])
    for toks, lps in got.values():  # the engine reports the raw distribution's log-probs
        row = np.zeros((1, 10), np.int32)
        row[0, :len(prompt) + len(toks)] = prompt + toks
        ours = np.asarray(completion_logps(model(jnp.asarray(row)), jnp.asarray(row), 1.0))[0]
        np.testing.assert_allclose(ours[len(prompt) - 1:len(prompt) - 1 + len(toks)], lps,
                                   atol=2e-5)


@pytest.mark.slow
def test_lora_reference_is_the_base(tmp_path):
    c = _cfg(steps=5, sft=3, beta=0.1)
    c.train.lr = 1e-2
    c.lora.update(dict(rank=4, alpha=8.0, targets="all"))
    trainer = GRPOTrainer(run_config(c), str(tmp_path), log=lambda s: None)
    ref = trainer.program.reference  # tfjax.train.reference, as DPO's
    assert ref is not None and ref.abstract is None  # no frozen copy: the base is the reference
    trainer.train()
    state = trainer.state
    assert "reference" not in state
    assert ref.parts(state)[0] is state["frozen"]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[3]["kl"] > 1e-3  # the warm-up moved the adapters away from the base


@pytest.mark.slow
def test_tiny_preset_reward_rises(tmp_path):
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "tfjax.train", "--config", "configs/grpo.py:tiny",
                        "--workdir", str(tmp_path), "--config.train.log_every=1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    took = time.perf_counter() - start
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rl = [r["rewards/exact_match"] for r in rows if "reward_mean" in r]
    assert len(rl) == 200
    first, last = np.mean(rl[:40]), np.mean(rl[-40:])
    print(f"tiny GRPO preset: {took:.0f} s; exact match {first:.2f} -> {last:.2f}")
    assert last > first + 0.2, (first, last)
    assert "reward_mean" in p.stdout and "clip_fraction" in p.stdout


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    def run(workdir, steps):
        c = _cfg(steps=steps, sft=2, num_iterations=2, beta=0.05)
        c.checkpoint.update(dict(enabled=True, every_steps=2, async_save=False))
        trainer = GRPOTrainer(run_config(c), str(workdir), log=lambda s: None)
        trainer.train()
        return trainer.state, [json.loads(line) for line in open(workdir / "metrics.jsonl")]

    whole, rows = run(tmp_path / "a", 10)
    run(tmp_path / "b", 6)
    resumed, rows_b = run(tmp_path / "b", 10)
    for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    drop = lambda r: {k: v for k, v in r.items() if not k.endswith("_s") and k != "time"}  # noqa
    assert [drop(r) for r in rows] == [drop(r) for r in rows_b]
