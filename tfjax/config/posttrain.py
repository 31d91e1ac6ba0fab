"""The post-training sections of `TrainConfig`: preference objectives (`train.preference`,
for dpo / ipo / orpo / simpo) and logit distillation (`train.distill`), with their checks.
Field names are TRL's (`DPOConfig`, `CPOConfig`, `ORPOConfig`, `GKDConfig`). See
docs/training.md ("Post-training")."""

from __future__ import annotations

import dataclasses

from tfjax.config.checks import fail, positive

__all__ = ["DistillConfig", "PREFERENCE_OBJECTIVES", "PreferenceConfig", "REFERENCE_OBJECTIVES"]

PREFERENCE_OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
REFERENCE_OBJECTIVES = ("dpo", "ipo")  # compared with the starting policy (the reference)


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """Preference optimisation on `{"prompt", "chosen", "rejected"}` pairs.

    beta: DPO's / IPO's beta (IPO's tau), SimPO's beta, ORPO's lambda (TRL names
      all of them `beta`); rewards are logged as beta x the log-ratio (dpo, ipo)
      or beta x the length-averaged log-prob (orpo, simpo), as TRL logs them.
    label_smoothing: the probability a preference label is flipped (dpo, simpo:
      the conservative sigmoid loss of cDPO and TRL's CPOTrainer); in [0, 0.5).
    simpo_gamma: SimPO's target reward margin gamma (TRL's `simpo_gamma`).
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Logit distillation from `train.teacher` (TRL GKD's `generalized_jsd_loss`).

    beta: 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher),
      in between the generalized Jensen-Shannon divergence with mixture
      beta * teacher + (1 - beta) * student.
    temperature: both logits are divided by it before the softmax.
    """

    beta: float = 0.5
    temperature: float = 1.0


def validate_posttrain(objective: str, pref: PreferenceConfig, distill: DistillConfig,
                       teacher: str, init_from: str, p: str = "train") -> None:
    positive(f"{p}.preference.beta", pref.beta)
    if not 0.0 <= pref.label_smoothing < 0.5:
        fail(f"{p}.preference.label_smoothing", f"must be in [0, 0.5) (the probability a "
             f"label is flipped), got {pref.label_smoothing!r}")
    if not 0.0 <= distill.beta <= 1.0:
        fail(f"{p}.distill.beta", f"must be in [0, 1] (0 forward KL, 1 reverse KL), got "
             f"{distill.beta!r}")
    positive(f"{p}.distill.temperature", distill.temperature)
    if objective in REFERENCE_OBJECTIVES and not init_from:
        fail(f"{p}.objective", f"{objective!r} compares the policy with its starting point "
             f"(the reference model), but init_from is empty; set --config.init_from=DIR (a "
             f"Hugging Face directory or a tfjax workdir), or use 'orpo' / 'simpo' (no "
             f"reference)")
    if objective == "distill" and not teacher:
        fail(f"{p}.teacher", "train.objective='distill' needs a teacher: set "
             "--config.train.teacher=DIR (a Hugging Face directory or a tfjax workdir)")
    if teacher and objective != "distill":
        fail(f"{p}.teacher", f"a teacher is read by train.objective='distill' only, but "
             f"train.objective={objective!r}; drop --config.train.teacher")
