"""Reinforcement learning on the one trainer's state: GRPO and GSPO with rollouts from
the inference engine. Modules: `losses` (advantages, log-probs, the policy loss, as
TRL), `rewards` (the reward registry), `tasks` (built-in verifiable prompts),
`rollout` (the engine on the policy), `loop` (`GRPOTrainer`). See docs/training.md
("Reinforcement learning: GRPO and GSPO")."""

from tfjax.train.rl.loop import GRPOTrainer, check_grpo
from tfjax.train.rl.losses import completion_logps, group_advantages, policy_loss
from tfjax.train.rl.rewards import REWARDS, score
from tfjax.train.rl.tasks import TASKS

__all__ = ["GRPOTrainer", "REWARDS", "TASKS", "check_grpo", "completion_logps",
           "group_advantages", "policy_loss", "score"]
