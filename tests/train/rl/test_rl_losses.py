"""`tfjax.train.rl.losses` against formulas written out here in numpy: group
advantages, log-probs at a temperature, the clipped policy loss (token and sequence
ratios, each loss type's normaliser, the k3 KL term) and its on-policy gradient."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.config.grpo import GRPOConfig
from tfjax.train.rl.losses import completion_logps, group_advantages, policy_loss


def test_group_advantages_by_hand():
    adv, std = group_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 2.0], 3)
    s = np.std([1.0, 0.0, 0.0], ddof=1)  # unbiased, as TRL's nanstd
    np.testing.assert_allclose(adv[:3], np.array([2 / 3, -1 / 3, -1 / 3]) / (s + 1e-4), rtol=1e-6)
    s2 = np.std([0.0, 2.0, 2.0], ddof=1)
    np.testing.assert_allclose(adv[3:], np.array([-4 / 3, 2 / 3, 2 / 3]) / (s2 + 1e-4), rtol=1e-6)
    np.testing.assert_allclose(std, np.repeat([s, s2], 3), rtol=1e-6)
    none, _ = group_advantages([1.0, 0.0, 3.0, 3.0], 2, "none")
    np.testing.assert_allclose(none, [0.5, -0.5, 0.0, 0.0])
    batch, bstd = group_advantages([1.0, 0.0, 3.0, 3.0], 2, "batch")
    np.testing.assert_allclose(bstd, np.std([1, 0, 3, 3], ddof=1), rtol=1e-6)
    np.testing.assert_allclose(batch, none / (np.std([1, 0, 3, 3], ddof=1) + 1e-4), rtol=1e-6)


@pytest.mark.parametrize("rewards,G", [([], 2), ([1.0, 2.0, 3.0], 2), ([[1.0, 2.0]], 2)])
def test_group_advantages_refuses_what_is_not_groups(rewards, G):
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(rewards, G)


def test_completion_logps_at_temperature():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, size=(2, 5))
    got = np.asarray(completion_logps(jnp.asarray(logits), jnp.asarray(tokens), 0.5))
    z = logits[:, :-1] / 0.5
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _reference(logps, old, ref, adv, mask, g, num_items=None):
    """The loss written out per completion and token (numpy, float64)."""
    lo, hi = 1 - g.epsilon, 1 + (g.epsilon_high or g.epsilon)
    B, T = logps.shape
    per = np.zeros((B, T))
    for b in range(B):
        n = max(mask[b].sum(), 1)
        seq = np.exp(((logps[b] - old[b]) * mask[b]).sum() / n)
        for t in range(T):
            r = seq if g.importance_sampling_level == "sequence" else np.exp(logps[b, t] - old[b, t])
            per[b, t] = -min(r * adv[b], np.clip(r, lo, hi) * adv[b])
            if g.beta:
                d = ref[b, t] - logps[b, t]
                kl = np.exp(d) - d - 1
                per[b, t] += g.beta * kl * (r if g.use_bias_correction_kl else 1.0)
    if g.loss_type == "grpo":
        return np.mean([(per[b] * mask[b]).sum() / max(mask[b].sum(), 1) for b in range(B)])
    if g.loss_type == "bnpo":
        return (per * mask).sum() / mask.sum()
    if g.loss_type == "dr_grpo":
        return (per * mask).sum() / (B * g.max_completion_length)
    return (per * mask).sum() / (mask.sum() if num_items is None else num_items)


def _inputs(seed=0, B=4, T=6):
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.1, 3.0, size=(B, T))
    old = logps + rng.normal(0, 0.4, size=(B, T))  # ratios well outside [0.8, 1.28]
    ref = logps + rng.normal(0, 0.5, size=(B, T))
    mask = (np.arange(T)[None] < np.array([6, 3, 1, 4])[:, None]).astype(np.float64)
    adv = np.array([1.5, -0.7, 0.3, -1.1])
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta,bias_kl", [(0.0, True), (0.1, True), (0.1, False)])
def test_policy_loss_by_hand(loss_type, level, beta, bias_kl):
    g = GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                   use_bias_correction_kl=bias_kl, epsilon=0.2, epsilon_high=0.28,
                   max_completion_length=8)
    logps, old, ref, adv, mask = _inputs()
    num_items = 20.0 if loss_type == "dapo" else None  # the whole rollout batch's tokens
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, m = policy_loss(f32(logps), f32(old), f32(ref), f32(adv), f32(mask), g, num_items)
    want = _reference(logps, old, ref, adv, mask, g, num_items)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    assert ("kl" in m) == bool(beta)
    if level == "token":
        assert 0 < float(m["clip_fraction"]) < 1
        r = np.exp(logps - old)
        low = (r < 0.8) & (adv[:, None] < 0)
        high = (r > 1.28) & (adv[:, None] > 0)
        np.testing.assert_allclose(float(m["clip_ratio_low"]), (low * mask).sum() / mask.sum(),
                                   rtol=1e-6)
        np.testing.assert_allclose(float(m["clip_ratio_high"]), (high * mask).sum() / mask.sum(),
                                   rtol=1e-6)


def test_epsilon_high_defaults_to_epsilon():
    logps, old, ref, adv, mask = _inputs(1)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    a = GRPOConfig(epsilon=0.2, epsilon_high=0.0)
    b = dataclasses.replace(a, epsilon_high=0.2)
    la, _ = policy_loss(f32(logps), f32(old), None, f32(adv), f32(mask), a)
    lb, _ = policy_loss(f32(logps), f32(old), None, f32(adv), f32(mask), b)
    assert float(la) == float(lb)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_on_policy_gradient_is_the_policy_gradient(loss_type):
    """Old log-probs = the current ones, stopped: d loss / d logp = -A x the loss type's
    token weight (the ratio's gradient, not zero: a planted missing stop_gradient fails)."""
    g = GRPOConfig(loss_type=loss_type)
    logps, _, _, adv, mask = _inputs(2)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def loss(lp):
        return policy_loss(lp, jax.lax.stop_gradient(lp), None, f32(adv), f32(mask), g)[0]

    grad = np.asarray(jax.grad(loss)(f32(logps)))
    if loss_type == "grpo":
        weight = mask / np.maximum(mask.sum(1, keepdims=True), 1) / mask.shape[0]
    else:
        weight = mask / mask.sum()
    np.testing.assert_allclose(grad, -adv[:, None] * weight, rtol=1e-5, atol=1e-7)


def test_masked_tokens_do_not_count():
    g = GRPOConfig(loss_type="grpo", beta=0.1)
    logps, old, ref, adv, mask = _inputs(3)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    noisy = np.where(mask > 0, logps, 50.0)  # garbage where the mask is 0
    a, ma = policy_loss(f32(logps), f32(old), f32(ref), f32(adv), f32(mask), g)
    b, mb = policy_loss(f32(noisy), f32(old), f32(ref), f32(adv), f32(mask), g)
    assert float(a) == pytest.approx(float(b), rel=1e-6)
    assert float(ma["kl"]) == pytest.approx(float(mb["kl"]), rel=1e-6)
