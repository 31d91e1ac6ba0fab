"""Logit distillation: the generalized Jensen-Shannon divergence between a teacher's and
the student's next-token distributions (TRL GKD's `generalized_jsd_loss`; beta 0 =
forward KL(teacher || student), 1 = reverse KL(student || teacher)), with a
temperature, summed over the scored tokens. See docs/training.md ("Post-training").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["distill_sums", "generalized_jsd"]


def _kl(log_p, log_q):
    """KL(p || q) over the last axis, from log-probabilities."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float = 1.0):
    """Per position `[...]`: beta x KL(teacher || m) + (1 - beta) x KL(student || m), m =
    beta x teacher + (1 - beta) x student, after dividing the logits `[..., V]` by
    `temperature`; beta 0 is KL(teacher || student), 1 is KL(student || teacher)."""
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, -1)
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, -1)
    if beta == 0:
        return _kl(t, s)
    if beta == 1:
        return _kl(s, t)
    m = jnp.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return beta * _kl(t, m) + (1 - beta) * _kl(s, m)


def distill_sums(model, b, teacher, *, beta: float, temperature: float) -> dict:
    """nll: the divergence summed over the scored tokens (`mask`); tokens, bytes as the
    causal LM counts them; z 0."""
    args = dict(positions=b["positions"], segment_ids=b["segment_ids"])
    student = model(b["inputs"], **args)
    target = jax.lax.stop_gradient(teacher(b["inputs"], **args))
    mask = b["mask"].astype(jnp.float32)
    div = generalized_jsd(student, target, beta, temperature)
    return dict(nll=(div * mask).sum(), z=jnp.zeros((), jnp.float32), tokens=mask.sum(),
                bytes=(b["target_bytes"].astype(jnp.float32) * mask).sum())
