"""Rollouts for RL from the inference engine (`Rollouts`): n completions per prompt
sampled by `tfjax.inference.engine.Engine` on the policy's current parameters (the
same arrays, handed to the engine's compiled step each time: no weight copy and no
recompilation), laid out as training rows (`RolloutBatch`). `sft_rows` lays out a
task's reference answers the same way. See docs/training.md ("Reinforcement
learning: GRPO and GSPO")."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from flax import nnx

from tfjax.config.grpo import GRPOConfig
from tfjax.inference.engine import Engine, EngineConfig, Request

__all__ = ["RolloutBatch", "Rollouts", "encode_prompt", "sft_rows"]


@dataclasses.dataclass
class RolloutBatch:
    """tokens `[B,T]` (prompt, completion, zero padding), mask `[B,T-1]` (1 where
    position t's next token is a completion token, EOS included), completions (text,
    EOS dropped), lengths `[B]` (completion tokens), rollout_s (wall seconds)."""

    tokens: np.ndarray
    mask: np.ndarray
    completions: list
    lengths: np.ndarray
    rollout_s: float


def encode_prompt(tokenizer, text: str, limit: int, where: str) -> list[int]:
    """[bos] + the prompt's ids; longer than `limit` is a one-line ValueError."""
    ids = [tokenizer.bos_id] + list(tokenizer.encode(text))
    if len(ids) > limit:
        raise ValueError(f"train.grpo.max_prompt_length: prompt {where} ({text[:40]!r}) has "
                         f"{len(ids)} tokens with BOS, more than {limit}; raise it")
    return ids


def _rows(prompts: list, completions: list, T: int):
    tokens = np.zeros((len(prompts), T), np.int32)
    mask = np.zeros((len(prompts), T - 1), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tokens[i, :len(p) + len(c)] = p + c
        mask[i, len(p) - 1:len(p) + len(c) - 1] = 1.0
    return tokens, mask


def sft_rows(tokenizer, examples: list, g: GRPOConfig):
    """(tokens, mask) of [bos] + prompt + answer + [eos]: the supervised warm-up's rows,
    the loss on the answer and EOS."""
    prompts = [encode_prompt(tokenizer, ex["prompt"], g.max_prompt_length, str(i))
               for i, ex in enumerate(examples)]
    answers = [(list(tokenizer.encode(ex["answer"])) + [tokenizer.eos_id])[
        :g.max_completion_length] for ex in examples]
    return _rows(prompts, answers, g.max_prompt_length + g.max_completion_length)


class Rollouts:
    """An engine on the policy: `sample(params, rest, examples, seed)` -> `RolloutBatch`.

    `graphdef` is the model's eval-mode structure; each call merges it with the given
    arrays (no copy) and hands their state to the engine built once in `__init__`,
    whose jitted steps (every shape compiled here, `Engine.warm_up`) then run on them."""

    def __init__(self, graphdef, params, rest, tokenizer, g: GRPOConfig, rows: int, *,
                 mesh=None, rules=None):
        self.graphdef, self.tokenizer, self.g, self.rows = graphdef, tokenizer, g, rows
        self.T = g.max_prompt_length + g.max_completion_length
        model = nnx.merge(graphdef, params, rest)
        # a decode step holds one token a row: "length" is not split
        rules = rules and tuple((n, None if n == "length" else a) for n, a in rules)
        self.engine = Engine(model, EngineConfig(max_seqs=rows, max_len=self.T, page_size=16,
                                                 chunk=min(32, g.max_prompt_length),
                                                 prefix_caching=False),
                             eos_ids=(tokenizer.eos_id,), mesh=mesh, rules=rules)
        self.engine.warm_up()  # every step shape now, not in the middle of a rollout

    def set_params(self, params, rest) -> None:
        """Point the engine at these arrays (the policy's current ones)."""
        _, self.engine.params = nnx.split(nnx.merge(self.graphdef, params, rest))

    def sample(self, params, rest, examples: list, seed: int) -> RolloutBatch:
        """`num_generations` completions of each example's prompt (a prompt's adjacent),
        sampled at `temperature` / top_k / top_p with seeds derived from `seed`."""
        g, tok = self.g, self.tokenizer
        start = time.perf_counter()
        self.set_params(params, rest)
        prompts = [encode_prompt(tok, ex["prompt"], g.max_prompt_length, str(i))
                   for i, ex in enumerate(examples)]
        sampling = dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        requests = [Request(p, max_tokens=g.max_completion_length, n=g.num_generations,
                            sampling=dict(sampling, seed=(seed * 7919 + i) % 2**32))
                    for i, p in enumerate(prompts)]
        out = self.engine.generate(requests)
        prompt_rows, completions, texts = [], [], []
        for p, r in zip(prompts, requests):
            for c in out[r.request_id]:
                prompt_rows.append(p)
                completions.append(c)
                body = c[:-1] if c and c[-1] == tok.eos_id else c
                texts.append(tok.decode(body))
        tokens, mask = _rows(prompt_rows, completions, self.T)
        return RolloutBatch(tokens, mask, texts, np.array([len(c) for c in completions]),
                            time.perf_counter() - start)
