"""GRPO / GSPO's pieces as TRL's `GRPOTrainer` computes them: group-normalised
advantages (`group_advantages`), per-token log-probabilities of completions at a
temperature (`completion_logps`) and the clipped policy loss with its k3 KL term
(`policy_loss`, token- or sequence-level ratios, loss types grpo / bnpo / dr_grpo /
dapo). Parity with TRL 1.16: tests/train/rl/test_rl_parity.py. See docs/training.md
("Reinforcement learning: GRPO and GSPO")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.config.grpo import GRPOConfig

__all__ = ["completion_logps", "group_advantages", "policy_loss"]


def group_advantages(rewards, num_generations: int, scale_rewards: str = "group"):
    """rewards `[B]` (B = prompts x num_generations, a prompt's completions adjacent)
    -> (advantages `[B]`, the std each was divided by `[B]`): reward minus its
    group's mean, over the group's ("group") or the batch's ("batch") unbiased std +
    1e-4, or unscaled ("none"), as TRL."""
    r = np.asarray(rewards, np.float64)
    G = num_generations
    if r.ndim != 1 or r.size == 0 or r.size % G:
        raise ValueError(f"rewards: {r.shape} does not divide into groups of "
                         f"num_generations={G}; give prompts x num_generations rewards")
    groups = r.reshape(-1, G)
    mean = np.repeat(groups.mean(1), G)
    if scale_rewards == "batch":
        std = np.full_like(r, r.std(ddof=1) if r.size > 1 else 0.0)
    else:
        std = np.repeat(groups.std(1, ddof=1), G)
    adv = r - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return adv.astype(np.float32), std.astype(np.float32)


def completion_logps(logits, tokens, temperature: float = 1.0):
    """logits `[B,T,V]` of positions 0..T-1 and tokens `[B,T]` -> log p(tokens[:, t+1]
    | ...) `[B,T-1]` float32 under softmax(logits / temperature) (TRL divides its
    logits by the sampling temperature too)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def policy_loss(logps, old_logps, ref_logps, advantages, mask, cfg: GRPOConfig,
                num_items: float | None = None):
    """The loss TRL's `GRPOTrainer._compute_loss` returns (one process, no gradient
    accumulation) and its metrics. logps, old_logps, ref_logps (None when beta = 0),
    mask: `[B,T]` over completion tokens; advantages `[B]`. num_items: the completion
    tokens of the whole rollout batch ("dapo"'s normaliser; default mask's sum)."""
    mask = mask.astype(jnp.float32)
    adv = advantages[:, None]
    log_ratio = logps - old_logps
    if cfg.importance_sampling_level == "sequence":  # GSPO: one ratio per completion
        log_ratio = ((log_ratio * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))[:, None]
    coef_1 = jnp.exp(log_ratio)
    eps_low, eps_high = cfg.epsilon, cfg.epsilon_high or cfg.epsilon
    coef_2 = jnp.clip(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -jnp.minimum(coef_1 * adv, coef_2 * adv)
    metrics = {}
    if cfg.beta:
        d = ref_logps - logps
        per_token_kl = jnp.exp(d) - d - 1  # k3, unbiased and >= 0
        if cfg.use_bias_correction_kl:  # x the ratio: the unbiased reverse-KL gradient
            per_token_kl = per_token_kl * coef_1
        per_token = per_token + cfg.beta * per_token_kl
        metrics["kl"] = _masked_mean(per_token_kl, mask)
    tokens = jnp.maximum(mask.sum(), 1.0)
    if cfg.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).mean()
    elif cfg.loss_type == "bnpo":
        loss = (per_token * mask).sum() / tokens
    elif cfg.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * cfg.max_completion_length)
    else:  # dapo
        loss = (per_token * mask).sum() / (tokens if num_items is None
                                           else jnp.maximum(num_items, 1.0))
    low = (coef_1 < 1 - eps_low) & (adv < 0)
    high = (coef_1 > 1 + eps_high) & (adv > 0)
    metrics.update(clip_ratio_low=_masked_mean(low, mask), clip_ratio_high=_masked_mean(high, mask),
                   clip_fraction=_masked_mean(low | high, mask))
    return loss, metrics


def _masked_mean(x, mask):
    """TRL's mean over completion tokens, or over completions for a `[B,1]` (GSPO) x."""
    x = x.astype(jnp.float32)
    if x.shape[1] == 1:
        return x.mean()
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)
