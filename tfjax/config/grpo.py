"""`train.grpo`: GRPO / GSPO settings (`tfjax.train.rl`), named as TRL's `GRPOConfig`
names them, and their range checks. See docs/training.md ("Reinforcement learning:
GRPO and GSPO")."""

from __future__ import annotations

import dataclasses

from tfjax.config.checks import fail, non_negative, one_of, positive

__all__ = ["GRPOConfig", "IMPORTANCE_SAMPLING_LEVELS", "LOSS_TYPES", "SCALE_REWARDS",
           "validate_grpo"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # GRPO, GSPO
SCALE_REWARDS = ("group", "batch", "none")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Read when train.objective="grpo"; `train.batch_size` counts completions per
    rollout batch (batch_size / num_generations prompts) and `train.steps` optimizer
    steps (a new rollout batch every `num_iterations` of them).

    num_generations: completions sampled per prompt (a group; >= 2).
    beta: weight of the k3 KL estimate to the reference (the starting policy); 0: none.
      use_bias_correction_kl: the estimate times the ratio (TRL's default since 1.x).
    epsilon, epsilon_high: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
      (epsilon_high 0: epsilon). num_iterations: updates per rollout batch (old
      log-probs kept from the rollout). importance_sampling_level: "token" (GRPO) or
      "sequence" (GSPO: the mean log-ratio of a completion). loss_type: "dapo" (TRL's
      default: sum over the batch's tokens / their count), "bnpo" (the same per
      update batch), "grpo" (per-completion token means, then their mean), "dr_grpo"
      (sum / (rows * max_completion_length)). scale_rewards: advantages divided by
      the group's ("group"), the batch's ("batch") or no ("none") reward std.
    temperature, top_k, top_p: the rollouts' sampling (log-probs use the same
      temperature, as TRL's). max_completion_length: tokens per completion.
    task: the built-in prompt task (`tfjax.train.rl.tasks.TASKS`); task_max: its
      operands' range. reward_funcs: reward names (`tfjax.train.rl.rewards.REWARDS`),
      summed with reward_weights (empty: 1 each). sft_steps: supervised warm-up steps
      on the task's answers before RL (the reference is the policy after them).
    """

    num_generations: int = 8
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    epsilon: float = 0.2
    epsilon_high: float = 0.0
    num_iterations: int = 1
    importance_sampling_level: str = "token"
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_completion_length: int = 16
    max_prompt_length: int = 32
    task: str = "add"
    task_max: int = 9
    reward_funcs: tuple[str, ...] = ("exact_match",)
    reward_weights: tuple[float, ...] = ()
    reward_timeout: float = 5.0
    sft_steps: int = 0


def validate_grpo(c: GRPOConfig, p: str) -> None:
    if c.num_generations < 2:
        fail(f"{p}.num_generations", f"got {c.num_generations}; group-normalised advantages "
             f"need at least 2 completions per prompt (e.g. --config.{p}.num_generations=4)")
    for name in ("num_iterations", "temperature", "max_completion_length",
                 "max_prompt_length", "reward_timeout", "task_max"):
        positive(f"{p}.{name}", getattr(c, name))
    for name in ("beta", "epsilon", "epsilon_high", "top_k", "sft_steps"):
        non_negative(f"{p}.{name}", getattr(c, name))
    if not 0.0 < c.top_p <= 1.0:
        fail(f"{p}.top_p", f"must be in (0, 1], got {c.top_p!r}")
    one_of(f"{p}.loss_type", c.loss_type, LOSS_TYPES)
    one_of(f"{p}.importance_sampling_level", c.importance_sampling_level,
           IMPORTANCE_SAMPLING_LEVELS)
    one_of(f"{p}.scale_rewards", c.scale_rewards, SCALE_REWARDS)
    if not c.reward_funcs:
        fail(f"{p}.reward_funcs", "names no reward; give e.g. ('exact_match',)")
    if c.reward_weights and len(c.reward_weights) != len(c.reward_funcs):
        fail(f"{p}.reward_weights", f"{len(c.reward_weights)} weights for "
             f"{len(c.reward_funcs)} reward_funcs; give one per function, or () for 1 each")
