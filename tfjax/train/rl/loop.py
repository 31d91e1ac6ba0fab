"""The GRPO / GSPO loop (`GRPOTrainer`, train.objective="grpo"): optional supervised
warm-up steps on the task's answers, then per rollout batch: prompts from the task,
completions from the engine (`tfjax.train.rl.rollout`), rewards (`rewards.score`),
group advantages, old and reference log-probs, and `num_iterations` jitted updates
of `policy_loss`. The state is the trainer's (`tfjax.train.program` of train.objective
"grpo"), its KL reference (beta > 0) that of `tfjax.train.reference`: a frozen copy
of the starting policy in `state["reference"]`, or with LoRA the base with the
adapters off (no copy). Checkpoints at rollout boundaries
resume exactly (a final save mid-batch resumes with a fresh rollout). See
docs/training.md ("Reinforcement learning: GRPO and GSPO")."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from tfjax import storage
from tfjax.config import RunConfig
from tfjax.data.tokenizer import load_tokenizer
from tfjax.models import build, check_names
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.rules import logical_rules, replicated
from tfjax.parallel.sharding import logical_to_spec
from tfjax.train.checkpoint import Checkpointer, abstract_with_shardings
from tfjax.train.compile_cache import persistent_compilation_cache
from tfjax.train.init_from import check_tokenizer, initial_state, resolve_init_from
from tfjax.train.lora import model_params
from tfjax.train.metrics import MetricWriter
from tfjax.train.program import build_program
from tfjax.train.rl.losses import completion_logps, group_advantages, policy_loss
from tfjax.train.rl.rewards import REWARDS, score
from tfjax.train.rl.rollout import Rollouts, sft_rows
from tfjax.train.rl.tasks import TASKS, examples
from tfjax.train.trainer import _plain, check_run

__all__ = ["GRPOTrainer", "check_grpo"]


def check_grpo(cfg: RunConfig) -> None:
    """Checks of a GRPO run that need the registries; each error names the field."""
    g, t = cfg.train.grpo, cfg.train
    if t.objective != "grpo":
        raise ValueError(f"train.objective: GRPOTrainer runs 'grpo', got {t.objective!r}; set "
                         f"--config.train.objective=grpo")
    for name in g.reward_funcs:
        REWARDS.get(name, field="train.grpo.reward_funcs")
    TASKS.get(g.task, field="train.grpo.task")
    if cfg.model.arch != "decoder":
        raise ValueError(f"train.objective: 'grpo' samples from a decoder-only model, but "
                         f"model.arch={cfg.model.arch!r}")
    if g.max_prompt_length + g.max_completion_length > t.seq_len:
        raise ValueError(f"train.seq_len: {t.seq_len} < train.grpo.max_prompt_length + "
                         f"max_completion_length = {g.max_prompt_length + g.max_completion_length}"
                         f"; raise seq_len or lower them")
    if t.microbatches != 1:
        raise ValueError("train.microbatches: GRPO updates take the rollout batch whole; set "
                         "--config.train.microbatches=1")


def make_update(graphdef, tx, g, merge=None, *, sft: bool = False):
    """A pure `update(state, batch) -> (state, metrics)`: one optimizer step on
    `policy_loss` (or, `sft`, on the answers' mean negative log-likelihood)."""

    def loss_fn(params, rest, frozen, batch):
        full = params if merge is None else merge(jax.tree.map(lambda x: x, frozen), params)
        model = nnx.merge(graphdef, full, jax.tree.map(lambda x: x, rest))
        logits = model(batch["tokens"])
        logps = completion_logps(logits, batch["tokens"], 1.0 if sft else g.temperature)
        mask = batch["mask"]
        if sft:
            loss = -(logps * mask).sum() / jnp.maximum(mask.sum(), 1.0)
            return loss, {}
        old = batch.get("old_logps", jax.lax.stop_gradient(logps))  # num_iterations 1: ratio 1
        return policy_loss(logps, old, batch.get("ref_logps"), batch["advantages"], mask, g,
                           batch["num_items"])

    def update(state, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["rest"], state.get("frozen"), batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = dict(state, step=state["step"] + 1, params=params, opt=opt)
        return new, dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))

    return update


class GRPOTrainer:
    """`GRPOTrainer(cfg, workdir).train()` -> the run's summary (see the module)."""

    def __init__(self, cfg: RunConfig, workdir: str, *, devices=None, log=None):
        storage.check_reachable(workdir, "--workdir")
        self.cfg = cfg = resolve_init_from(cfg.validate())
        self.workdir = workdir
        self.log = log or (lambda s: print(s, flush=True) if jax.process_index() == 0 else None)
        check_names(cfg.model)
        check_grpo(cfg)
        self.g, t = cfg.train.grpo, cfg.train
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        check_tokenizer(cfg, self.tokenizer)
        self.mesh = make_mesh(cfg.mesh, devices)
        self.rules = logical_rules(cfg.mesh.rules)
        # the device and data checks of a decoder LM (the "grpo" record's own check
        # sends a Trainer here)
        check_run(dataclasses.replace(cfg, train=dataclasses.replace(t, objective="causal_lm")),
                  self.mesh, self.tokenizer)
        # the program of "grpo": init, optimizer, shardings and the KL reference
        # (`program.reference`, beta > 0); its train step is never called (jit compiles
        # lazily): the updates are `make_update`'s
        p = self.program = build_program(cfg, self.mesh, build)
        self.abstract, self.shardings = p.abstract_state, p.state_shardings
        rep = replicated(self.mesh)
        merge = p.lora and p.lora.merge
        jit = lambda f: jax.jit(f, out_shardings=(self.shardings, rep), donate_argnums=0)  # noqa
        self.update = jit(make_update(p.graphdef, p.tx, self.g, merge))
        self.sft_update = jit(make_update(p.graphdef, p.tx, self.g, merge, sft=True))
        temperature = self.g.temperature

        def logps(params, rest, tokens):  # the policy's, or the reference's
            model = nnx.merge(p.eval_graphdef, params, rest)
            return completion_logps(model(tokens), tokens, temperature)

        self.logps = jax.jit(logps, out_shardings=rep)
        self.checkpointer = Checkpointer(workdir, cfg.checkpoint)

    # ------------------------------------------------------------------ state
    def _fresh(self):
        p = self.program  # its start copies the starting policy into the reference
        return initial_state(p, self.cfg, self.mesh, self.log) if self.cfg.init_from \
            else p.init()

    def restore_or_init(self):
        c = self.cfg.checkpoint
        if c.enabled and c.resume:
            got = self.checkpointer.restore(abstract_with_shardings(self.abstract, self.shardings),
                                            set_aside=True, warn=lambda s: self.log(f"  warning: {s}"))
            if got is not None:
                return got[0], got[2]
        elif c.enabled and (steps := self.checkpointer.all_steps()):
            raise ValueError(f"checkpoint.resume=False, but {self.checkpointer.directory} holds "
                             f"steps {steps}; use a new --workdir")
        return self._fresh(), 0

    # ---------------------------------------------------------------- batches
    def _seed(self, step: int) -> int:
        return (self.cfg.seed * 1_000_003 + step) % 2**31

    def _batch(self, arrays: dict) -> dict:
        def sharding(v):  # rows over the batch axes
            return NamedSharding(self.mesh, logical_to_spec(("batch", None)[:np.ndim(v)],
                                                            self.rules))
        return {k: jax.device_put(v, sharding(v)) for k, v in arrays.items()}

    def sft_batch(self, step: int) -> dict:
        g = self.g
        exs = examples(g.task, self.cfg.train.batch_size, self._seed(step), g.task_max)
        tokens, mask = sft_rows(self.tokenizer, exs, g)
        return self._batch(dict(tokens=tokens, mask=mask))

    def rollout(self, state, rollouts: Rollouts, step: int) -> tuple[dict, dict]:
        """(the update batch, its metrics) of one rollout batch."""
        g, t = self.g, self.cfg.train
        exs = examples(g.task, t.batch_size // g.num_generations, self._seed(step), g.task_max)
        policy = model_params(self.program.lora, state)
        r = rollouts.sample(policy, state["rest"], exs, self._seed(step))
        group = [ex for ex in exs for _ in range(g.num_generations)]
        rewards, per_func = score(g.reward_funcs, g.reward_weights, [e["prompt"] for e in group],
                                  r.completions, group)
        adv, std = group_advantages(rewards, g.num_generations, g.scale_rewards)
        arrays = dict(tokens=r.tokens, mask=r.mask, advantages=adv,
                      num_items=np.float32(r.mask.sum()))
        batch = self._batch(arrays)
        if g.num_iterations > 1:
            batch["old_logps"] = self.logps(policy, state["rest"], batch["tokens"])
        if g.beta:  # the reference: the LoRA base, or state["reference"]
            batch["ref_logps"] = self.logps(*self.program.reference.parts(state),
                                            batch["tokens"])
        rw = np.asarray(rewards)
        groups_std = rw.reshape(-1, g.num_generations).std(1, ddof=1)
        metrics = dict(reward_mean=float(rw.mean()), reward_std=float(groups_std.mean()),
                       frac_reward_zero_std=float(np.isclose(groups_std, 0).mean()),
                       completion_length=float(r.lengths.mean()), rollout_s=r.rollout_s,
                       **{f"rewards/{k}": v for k, v in per_func.items()})
        return batch, metrics

    # ------------------------------------------------------------------- loop
    def train(self) -> dict:
        """Run to `train.steps` (resuming from the latest checkpoint); returns the
        summary: `step` and `history` (each step's logged record)."""
        with persistent_compilation_cache(self.cfg.train.compilation_cache, self.workdir):
            return self._train()

    def _train(self) -> dict:
        cfg, g, t = self.cfg, self.g, self.cfg.train
        log = self.log
        state, start = self.restore_or_init()
        log(f"tfjax.train (grpo): {self.program.num_params / 1e6:.2f}M parameters, "
            f"{t.batch_size // g.num_generations} prompts x {g.num_generations} completions, "
            f"{g.importance_sampling_level}-level ratios, loss_type {g.loss_type}, beta {g.beta}"
            + (f"; resumed from step {start}" if start else ""))
        if jax.process_index() == 0:
            storage.path(self.workdir).mkdir(parents=True, exist_ok=True)
            storage.write_atomic(os.path.join(self.workdir, "config.json"),
                                 json.dumps(_plain(cfg), indent=1).encode())
        writer = MetricWriter(self.workdir, resume_step=start, wandb=t.wandb,
                              wandb_mode=t.wandb_mode, config=_plain(cfg))
        p = self.program
        rollouts = Rollouts(p.eval_graphdef, model_params(p.lora, state), state["rest"],
                            self.tokenizer, g, t.batch_size, mesh=self.mesh, rules=self.rules)
        self.rollouts = rollouts
        history, batch, rollout_metrics = [], None, {}
        step = start
        try:
            while step < t.steps:
                rl = step - g.sft_steps
                if rl < 0:
                    tick = time.perf_counter()
                    state, m = self.sft_update(state, self.sft_batch(step))
                    rec = dict(sft_loss=float(m["loss"]), grad_norm=float(m["grad_norm"]),
                               update_s=time.perf_counter() - tick)
                else:
                    ref = self.program.reference
                    if rl == 0 and g.sft_steps and ref is not None and ref.abstract is not None:
                        # the reference: the warmed-up policy (LoRA: the base stays it)
                        state["reference"] = ref.start(state["params"], state["rest"])
                    if rl % g.num_iterations == 0 or batch is None:  # (None: resumed mid-way)
                        batch, rollout_metrics = self.rollout(state, rollouts, step)
                    tick = time.perf_counter()
                    state, m = self.update(state, batch)
                    rec = {**rollout_metrics, **{k: float(v) for k, v in m.items()},
                           "update_s": time.perf_counter() - tick}
                step += 1
                history.append(rec)
                if step % t.log_every == 0 or step == t.steps:
                    writer.write(step, **rec)
                    log(f"step {step}: " + " ".join(
                        f"{k} {v:.3f}" for k, v in rec.items() if "/" not in k))
                boundary = step <= g.sft_steps or (step - g.sft_steps) % g.num_iterations == 0
                every = cfg.checkpoint.every_steps
                if cfg.checkpoint.enabled and every and step % every == 0 and boundary:
                    self.checkpointer.save(step, state, {"step": step})
            if cfg.checkpoint.enabled:
                self.checkpointer.save(step, state, {"step": step}, wait=True)
        finally:
            self.checkpointer.close()
            writer.close()
        self.state = state
        return dict(step=step, history=history)

