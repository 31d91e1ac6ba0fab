"""Preference losses on packed pairs (`tfjax.data.pairs`): per-sequence log-prob sums of
the responses, then DPO (sigmoid), IPO, ORPO or SimPO per pair, as TRL 1.16 defines them
(`DPOTrainer` loss_type "sigmoid" / "ipo", `ORPOTrainer.odds_ratio_loss`,
`CPOTrainer.cpo_loss` with loss_type "simpo"), and the rewards TRL logs. See
docs/training.md ("Post-training").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfjax.config import PreferenceConfig
from tfjax.train.losses import token_log_probs

__all__ = ["pair_losses", "pair_sums", "sequence_sums", "token_logps"]


def token_logps(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits `[B, T, V]`, targets `[B, T]` -> log p(target) `[B, T]` in float32."""
    logits = logits.astype(jnp.float32)
    target = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), -1)[..., 0]
    return target - jax.nn.logsumexp(logits, axis=-1)


def sequence_sums(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """`x` `[B, T]` summed per sequence of a packed pair row -> `[B, P, 2]` (pair k's
    chosen: segment 2k + 1, rejected: 2k + 2; P = ceil(T / 2) bounds the pairs)."""
    B, T = x.shape
    P = (T + 1) // 2
    n = 2 * P + 1
    idx = jnp.arange(B)[:, None] * n + jnp.minimum(segment_ids, 2 * P)
    out = jax.ops.segment_sum(x.reshape(-1), idx.reshape(-1), num_segments=B * n)
    return out.reshape(B, n)[:, 1:].reshape(B, P, 2)


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0 (TRL's branch at -ln 2)."""
    t = -0.6931471805599453
    return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))),
                     jnp.log(-jnp.expm1(jnp.maximum(x, t))))


def _sigmoid_loss(logits, beta, smoothing):
    return (-jax.nn.log_sigmoid(beta * logits) * (1 - smoothing)
            - jax.nn.log_sigmoid(-beta * logits) * smoothing)


def pair_losses(kind: str, cfg: PreferenceConfig, logps, lengths, ref_logps=None):
    """Per pair: (loss, chosen reward, rejected reward), each `[...]`.

    logps, lengths, ref_logps: `[..., 2]` (chosen, rejected) summed response log-probs
    of the policy, response token counts, and the reference's log-prob sums (dpo,
    ipo). ORPO's loss here is its odds-ratio term alone (-beta x log sigmoid(log
    odds)); the trainer adds the NLL of the chosen sequences.
    """
    beta = cfg.beta
    if kind in ("dpo", "ipo"):
        ratio = logps - ref_logps
        rewards = beta * ratio
        if kind == "dpo":
            loss = _sigmoid_loss(ratio[..., 0] - ratio[..., 1], beta, cfg.label_smoothing)
        else:
            avg = ratio / jnp.maximum(lengths, 1.0)
            loss = jnp.square(avg[..., 0] - avg[..., 1] - 1 / (2 * beta))
        return loss, rewards[..., 0], rewards[..., 1]
    avg = logps / jnp.maximum(lengths, 1.0)  # length-averaged log-probs
    rewards = beta * avg
    if kind == "simpo":
        logits = avg[..., 0] - avg[..., 1] - cfg.simpo_gamma / beta
        loss = _sigmoid_loss(logits, beta, cfg.label_smoothing)
    elif kind == "orpo":
        log_odds = (avg[..., 0] - avg[..., 1]) - (_log1mexp(avg[..., 0]) - _log1mexp(avg[..., 1]))
        loss = -beta * jax.nn.log_sigmoid(log_odds)
    else:
        raise ValueError(f"train.objective: {kind!r} is not a preference objective")
    return loss, rewards[..., 0], rewards[..., 1]


def _response_logps(model, b, loss_chunk: int) -> jax.Array:
    """log p(target) `[B, T]` of `model` on the batch; with `loss_chunk` (and T >
    loss_chunk) through its `hidden`, `head_input` and `head`, a chunk of positions at a
    time (no `[B, T, V]` logits held)."""
    args = dict(positions=b["positions"], segment_ids=b["segment_ids"])
    if loss_chunk and b["targets"].shape[1] > loss_chunk and hasattr(model, "hidden"):
        features = model.head_input(model.hidden(b["inputs"], **args))
        return token_log_probs(model.head, features, b["targets"], chunk=loss_chunk)
    return token_logps(model(b["inputs"], **args), b["targets"])


def pair_sums(kind: str, cfg: PreferenceConfig, model, b, reference=None,
              loss_chunk: int = 0) -> dict:
    """The loss sums of a batch of packed pairs (`tfjax.data.pairs.PAIR_KEYS`): nll (the
    pair losses), tokens (pairs), chosen / rejected rewards, wins (chosen reward >
    rejected), margins; ORPO adds sft_nll / sft_tokens (every target of the chosen
    sequences, TRL's NLL term). `loss_chunk`: `train.loss_chunk` (`_response_logps`)."""
    seg = b["segment_ids"]
    lp = _response_logps(model, b, loss_chunk)
    mask = b["mask"].astype(jnp.float32)
    logps = sequence_sums(lp * mask, seg)
    lengths = sequence_sums(mask, seg)
    ref = None
    if reference is not None:
        rlp = _response_logps(reference, b, loss_chunk)
        ref = jax.lax.stop_gradient(sequence_sums(rlp * mask, seg))
    valid = (jnp.arange(logps.shape[1])[None] < b["pairs"][:, None]).astype(jnp.float32)
    # the empty slots past a row's pairs: finite stand-ins (ORPO's log(1 - p) at p = 1
    # would be -inf, and its NaN would reach the gradient through the mask)
    logps = jnp.where(valid[..., None] > 0, logps, -1.0)
    loss, chosen, rejected = pair_losses(kind, cfg, logps, lengths, ref)
    zero = jnp.zeros((), jnp.float32)
    out = dict(nll=(loss * valid).sum(), z=zero, tokens=valid.sum(), bytes=zero,
               chosen_rewards=(chosen * valid).sum(), rejected_rewards=(rejected * valid).sum(),
               wins=((chosen > rejected) * valid).sum(), margins=((chosen - rejected) * valid).sum())
    if kind == "orpo":
        sft = b["seq_mask"].astype(jnp.float32) * (seg % 2 == 1)
        out.update(sft_nll=-(lp * sft).sum(), sft_tokens=sft.sum())
    return out
