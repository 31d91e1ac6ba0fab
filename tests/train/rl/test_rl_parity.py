"""Parity of `tfjax.train.rl` with TRL 1.16's `GRPOTrainer` on a random tiny Llama
loaded into tfjax: the loss TRL's `_compute_loss` returns (its own per-token log-probs
from the Hugging Face model, through its fused LM head at the sampling temperature)
equals the loss of tfjax's update step (log-probs from the tfjax model) within 1e-5,
with its kl and clip metrics and its gradient's global norm, for GRPO and GSPO, beta 0 and > 0, num_iterations 1
and 2 (old log-probs off the policy: ratios != 1); and the group advantages equal
TRL's formula computed with its own `nanstd`."""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from trl import GRPOConfig as TRLConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, nanstd  # noqa: E402

from tfjax.config.grpo import GRPOConfig  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.train.rl.loop import make_update  # noqa: E402
from tfjax.train.rl.losses import completion_logps, group_advantages  # noqa: E402

V, P, C, G = 64, 4, 6, 3  # vocab, prompt tokens, completion tokens, generations
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).float().eval()
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    model.save_pretrained(path)
    ours, _ = hf.load(path, dtype="float32")
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model, ours


def _batch(seed=0):
    """Two prompts x G completions of different lengths (right-padded), rewards."""
    rng = np.random.default_rng(seed)
    B = 2 * G
    prompts = np.repeat(rng.integers(3, V, size=(2, P)), G, axis=0)
    completions = rng.integers(3, V, size=(B, C))
    lengths = np.array([6, 3, 1, 5, 6, 2])
    cmask = (np.arange(C)[None] < lengths[:, None]).astype(np.float32)
    completions = np.where(cmask > 0, completions, 0)
    rewards = np.array([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])
    return prompts, completions, cmask, rewards


def _stub(trl_args, model):
    """A GRPOTrainer with just what `_compute_loss` reads (one process, no accumulation)."""
    t = object.__new__(GRPOTrainer)
    t.args, t.model = trl_args, model
    for name in ("beta", "loss_type", "importance_sampling_level", "temperature",
                 "top_entropy_quantile", "off_policy_mask_threshold", "max_completion_length",
                 "epsilon_high", "vllm_importance_sampling_correction"):
        setattr(t, name, getattr(trl_args, name))
    t.epsilon_low = trl_args.epsilon
    t.use_vllm, t.aux_loss_enabled, t._entropy_bonus_enabled = False, False, False
    t.current_gradient_accumulation_steps = 1
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.accelerator = types.SimpleNamespace(
        autocast=contextlib.nullcontext, num_processes=1, is_main_process=True, gather=lambda x: x,
        gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x)
    return t


CASES = [(level, beta, iters, loss, True)
         for level in ("token", "sequence") for beta in (0.0, 0.04) for iters in (1, 2)
         for loss in ("grpo", "dapo")] + [
    ("token", 0.04, 2, "bnpo", True), ("sequence", 0.0, 2, "dr_grpo", True),
    ("token", 0.04, 2, "dapo", False), ("sequence", 0.04, 2, "grpo", False)]


FAST = {("token", 0.0, 1, "grpo", True), ("token", 0.04, 2, "dapo", True),
        ("sequence", 0.04, 1, "dapo", True), ("sequence", 0.0, 2, "grpo", True)}


@pytest.mark.parametrize("level,beta,iters,loss_type,bias_kl", [
    c if c in FAST else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_loss_matches_trl(models, tmp_path, level, beta, iters, loss_type, bias_kl):
    hf_model, ours = models
    eps, eps_high = (3e-4, 4e-4) if level == "sequence" else (0.2, 0.28)
    trl_args = TRLConfig(output_dir=str(tmp_path), beta=beta, epsilon=eps,
                         epsilon_high=eps_high, importance_sampling_level=level,
                         loss_type=loss_type, temperature=TEMPERATURE, num_iterations=iters,
                         max_completion_length=C, num_generations=G, report_to=[],
                         use_cpu=True, per_device_train_batch_size=2 * G,
                         use_bias_correction_kl=bias_kl)
    g = GRPOConfig(num_generations=G, beta=beta, epsilon=eps, epsilon_high=eps_high,
                   num_iterations=iters, importance_sampling_level=level, loss_type=loss_type,
                   temperature=TEMPERATURE, max_completion_length=C, max_prompt_length=P,
                   use_bias_correction_kl=bias_kl)
    prompts, completions, cmask, rewards = _batch()
    adv, _ = group_advantages(rewards, G)
    tokens = np.concatenate([prompts, completions], 1).astype(np.int32)
    mask = np.zeros((2 * G, P + C - 1), np.float32)
    mask[:, P - 1:] = cmask
    graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
    logps_fn = jax.jit(lambda p, r, x: _logps(graphdef, p, r, x))
    current = np.asarray(logps_fn(params, rest, jnp.asarray(tokens)))[:, P - 1:]
    rng = np.random.default_rng(1)
    old = current + rng.normal(0, 0.3, current.shape).astype(np.float32) * (iters > 1)
    ref = current + rng.normal(0, 0.3, current.shape).astype(np.float32)

    inputs = dict(prompt_ids=torch.tensor(prompts), prompt_mask=torch.ones(2 * G, P),
                  completion_ids=torch.tensor(completions), completion_mask=torch.tensor(cmask),
                  advantages=torch.tensor(adv), num_items_in_batch=torch.tensor(cmask.sum()))
    batch = dict(tokens=tokens, mask=mask, advantages=adv, num_items=np.float32(cmask.sum()))
    if iters > 1:
        inputs["old_per_token_logps"] = torch.tensor(old)
        batch["old_logps"] = np.pad(old, ((0, 0), (P - 1, 0)))
    if beta:
        inputs["ref_per_token_logps"] = torch.tensor(ref)
        batch["ref_logps"] = np.pad(ref, ((0, 0), (P - 1, 0)))
    stub = _stub(trl_args, hf_model)
    hf_model.train()  # TRL's "train" metrics; Llama has no dropout
    hf_model.zero_grad()
    loss = GRPOTrainer._compute_loss(stub, hf_model, inputs)
    loss.backward()
    theirs = float(loss)
    their_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum()
                                      for p in hf_model.parameters() if p.grad is not None)))
    tx = optax.sgd(0.0)
    state = dict(step=jnp.zeros((), jnp.int32), params=params, opt=tx.init(params), rest=rest)
    _, m = jax.jit(make_update(graphdef, tx, g))(state, jax.tree.map(jnp.asarray, batch))
    np.testing.assert_allclose(float(m["loss"]), theirs, atol=1e-5, rtol=0)
    # the same gradient: its global norm (the weights are the same numbers, laid out
    # differently) within float32 rounding
    np.testing.assert_allclose(float(m["grad_norm"]), their_norm, rtol=1e-4)
    metrics = stub._metrics["train"]
    if beta:
        np.testing.assert_allclose(float(m["kl"]), metrics["kl"][0], atol=1e-5, rtol=0)
    else:
        assert "kl" not in m
    np.testing.assert_allclose(float(m["clip_fraction"]), metrics["clip_ratio/region_mean"][0],
                               atol=1e-6)
    np.testing.assert_allclose(float(m["clip_ratio_low"]), metrics["clip_ratio/low_mean"][0],
                               atol=1e-6)
    if iters > 1 and level == "token":  # off-policy: some ratios clipped
        assert metrics["clip_ratio/region_mean"][0] > 0


def _logps(graphdef, params, rest, tokens):
    model = nnx.merge(graphdef, params, rest)
    return completion_logps(model(tokens), tokens, TEMPERATURE)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trl(scale):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, 0.0, 3.0, -1.0, 0.5])
    G = 4
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    want = rewards - mean
    if scale != "none":
        want = want / (std + 1e-4)
    adv, got_std = group_advantages(rewards.numpy(), G, scale)
    np.testing.assert_allclose(adv, want.numpy(), atol=1e-6)
    np.testing.assert_allclose(got_std, std.numpy(), atol=1e-6)
    assert (adv[4:8] == 0).all()  # a group of equal rewards teaches nothing
