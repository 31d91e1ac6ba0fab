"""Issue 49's "Out": the trained policy of a dpo run (LoRA, merged) and of a grpo run
(a frozen reference copy in its checkpoint) exports to Hugging Face format
(`tfjax.export`); transformers loads it with the policy's logits, and `tfjax.eval`
(`load_source`) and the engine read it. Slow: each trains a tiny Llama a few steps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pairs_data import write_pairs
from test_posttrain import _dpo_config, hf_llama  # noqa: F401 -- the module's fixture

from configs.grpo import get_config as grpo_config
from tfjax import config as C
from tfjax.eval.loading import load_source
from tfjax.export import export_run
from tfjax.inference.engine import Engine, EngineConfig, Request
from tfjax.train import Trainer
from tfjax.train.lora import model_params
from tfjax.train.rl import GRPOTrainer

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")


def _policy(program, state):
    """The trained policy (a LoRA run's base merged with its adapters), eval mode."""
    return nnx.merge(program.eval_graphdef, model_params(program.lora, state), state["rest"])


def _check_export(workdir, out, policy, base_dir):
    ids = np.random.default_rng(0).integers(0, 259, size=(2, 11))
    want = np.asarray(policy(jnp.asarray(ids)))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        start = base(torch.tensor(ids)).logits.numpy()
    assert np.abs(want - start).max() > 1e-4  # training moved the policy

    export_run(str(workdir), str(out))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        np.testing.assert_allclose(theirs(torch.tensor(ids)).logits.numpy(), want, atol=1e-4)
    src = load_source(hf=str(out))  # what tfjax.eval and tfjax.serve read
    np.testing.assert_allclose(np.asarray(src.model(jnp.asarray(ids))), want, atol=1e-5)

    prompt = src.encode("copy apple:", True)
    engine = Engine(src.model, EngineConfig(max_seqs=2, max_len=32, page_size=8, chunk=16))
    got = engine.generate([Request(prompt, max_tokens=4, sampling=dict(temperature=0.0),
                                   ignore_eos=True, request_id="r")])["r"][0]
    row = list(prompt)
    for _ in range(4):  # the policy's own greedy tokens
        row.append(int(np.argmax(np.asarray(policy(jnp.asarray([row])))[0, -1])))
    assert got == row[len(prompt):]


@pytest.mark.slow  # ~40 s: a LoRA DPO run compiles, then the export
def test_dpo_lora_policy_exports_merged(tmp_path, hf_llama):  # noqa: F811
    data = write_pairs(tmp_path / "pairs.jsonl", n=16)
    cfg = dataclasses.replace(_dpo_config(hf_llama, data, steps=2, lr=1e-2),
                              lora=C.LoraConfig(rank=4, alpha=8.0, targets="all"))
    tr = Trainer(cfg, str(tmp_path / "w"), devices=jax.devices()[:1], log=lambda s: None)
    tr.train()
    assert tr.program.lora is not None
    _check_export(tmp_path / "w", tmp_path / "hf", _policy(tr.program, tr.state), hf_llama)


@pytest.mark.slow  # ~60 s: the GRPO loop compiles its programs, then the export
def test_grpo_policy_exports_beside_its_reference(tmp_path, hf_llama):  # noqa: F811
    c = grpo_config()
    c.init_from = hf_llama
    c.train.update(dict(steps=3, batch_size=8, seq_len=16, lr=1e-2))
    c.train.grpo.update(dict(num_generations=4, beta=0.04, sft_steps=1, task_max=6,
                             max_prompt_length=8, max_completion_length=4))
    c.mesh.data = 1
    tr = GRPOTrainer(C.run_config(c), str(tmp_path / "w"), devices=jax.devices()[:1],
                     log=lambda s: None)
    tr.train()
    assert "reference" in tr.state  # saved with the run; export reads the policy alone
    _check_export(tmp_path / "w", tmp_path / "hf", _policy(tr.program, tr.state), hf_llama)
