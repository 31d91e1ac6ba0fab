"""Post-training measured on this CPU (issue 49): DPO step time against TRL, GRPO's time split.

1. DPO: one random Llama-shaped Hugging Face model (float32, saved with save_pretrained,
   the byte tokenizer's tokenizer.json beside it) and one set of synthetic pairs (prompt,
   chosen and rejected of fixed byte lengths, so of fixed token lengths on both sides).
   TRL 1.16's `DPOTrainer` (loss_type sigmoid, beta 0.1, a reference model copied from
   the policy, no precomputed reference log-probs; torch threads = the cores, and 1)
   timed per optimizer step by a callback after warm-up steps; tfjax's `configs/dpo.py`
   through `python -m tfjax.train` with `init_from` the same directory and the same pairs
   per step, its per-step `step_time_s` (metrics.jsonl, log_every 1) after the compile
   step (2 CPU devices, the default, and 1); with `--tunix-python`, google-tunix's
   `DPOTrainer` in that venv on the same weights and pairs. Each in its own process, one
   after the other, in alternating rounds; ratios are taken within a round.
2. GRPO: `configs/grpo.py:tiny` run in a child process with timers around the rollout
   batch's parts (the engine's sampling, the reward functions, the old / reference
   log-probs) and the trainer's own `update_s`; with `--tunix-python`, google-tunix's
   `GRPOLearner` (its `RLCluster`, vanilla rollout) in that venv on the same task after
   it: the tfjax run's policy after its warm-up (exported to HF, loaded into tunix's
   Llama3), its rollout batches' prompts, tfjax's reward functions, the same settings;
   the same parts of each rollout batch timed, side by side.

    python experiments/posttrain.py            # ~6 min on 2 cores (2 rounds of DPO, GRPO)
    python experiments/posttrain.py --tunix-python /tmp/tunix_venv/bin/python   # + tunix, ~11
    python experiments/posttrain.py --skip dpo --tunix-python /tmp/tunix_venv/bin/python
    python experiments/posttrain.py --quick    # tiny sizes, proves it runs

Results: experiments/results/posttrain_cpu.md (see docs/training.md, "Post-training").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time

from common import HERE, Experiment

ROOT = os.path.dirname(HERE)


# ------------------------------------------------------------------ shared inputs
def make_model(path: str, layers: int, d: int, heads: int, d_ff: int, max_len: int) -> None:
    """A random Llama (float32) in `path`, with the byte tokenizer's tokenizer.json."""
    import torch
    import transformers

    from tfjax.data.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=272, hidden_size=d, intermediate_size=d_ff,
                                 num_hidden_layers=layers, num_attention_heads=heads,
                                 num_key_value_heads=heads, max_position_embeddings=max_len,
                                 rms_norm_eps=1e-6, tie_word_embeddings=False,
                                 bos_token_id=257, eos_token_id=258, pad_token_id=256)
    transformers.LlamaForCausalLM(c).to(torch.float32).save_pretrained(path)
    ByteTokenizer().hf_tokenizer().save(os.path.join(path, "tokenizer.json"))


def make_pairs(path: str, n: int, prompt_len: int, response_len: int) -> None:
    """n pairs of lowercase ASCII text: exactly prompt_len / response_len bytes (= tokens)."""
    rng = random.Random(0)
    letters = string.ascii_lowercase + " "

    def text(k):
        return "".join(rng.choice(letters) for _ in range(k))

    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(dict(prompt=text(prompt_len), chosen=text(response_len),
                                    rejected=text(response_len))) + "\n")


# ------------------------------------------------------------------ child: TRL
def run_trl(a) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(a.threads or os.cpu_count())
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(a.model, "tokenizer.json"), bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>", pad_token="<|pad|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    rows = [json.loads(line) for line in open(a.pairs)]
    data = datasets.Dataset.from_list(rows)
    times: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    cfg = trl.DPOConfig(
        output_dir=a.workdir, per_device_train_batch_size=a.batch, max_steps=a.warmup + a.steps,
        learning_rate=5e-7, lr_scheduler_type="constant", beta=0.1, loss_type=["sigmoid"],
        precompute_ref_log_probs=False, max_length=None, logging_strategy="no",
        save_strategy="no", eval_strategy="no", report_to="none", use_cpu=True,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, bf16=False, fp16=False)
    trainer = trl.DPOTrainer(model=model, args=cfg, train_dataset=data, processing_class=tok,
                             callbacks=[StepTimer()])
    ex = trainer.train_dataset[0]
    lens = (len(ex["prompt_ids"]), len(ex["chosen_ids"]), len(ex["rejected_ids"]))
    trainer.train()
    return dict(times=times[a.warmup:], lens=lens, threads=torch.get_num_threads(),
                ref=type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
                trl=trl.__version__, torch=torch.__version__)


# ------------------------------------------------------------------ child: GRPO split
def run_grpo(a) -> dict:
    import importlib.util

    from tfjax.config import run_config
    from tfjax.parallel.mesh import use_cpu_cores

    spec = importlib.util.spec_from_file_location("grpo_preset",
                                                  os.path.join(ROOT, "configs", "grpo.py"))
    preset = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preset)
    c = preset.get_config("tiny")
    c.checkpoint.enabled = False  # time the loop, not the saves
    c.train.log_every = 1000
    if a.quick:
        c.train.update(dict(steps=12))
        c.train.grpo.update(dict(sft_steps=4))
    cfg = run_config(c)
    devices = use_cpu_cores(cfg.mesh, cfg.train.batch_size)  # as python -m tfjax.train does

    import jax

    from tfjax.train.rl import GRPOTrainer
    from tfjax.train.rl import loop as rl_loop

    spans: dict[str, list[float]] = {"reward": [], "logps": [], "prepare": [],
                                     "prepare_compile": [], "sample_compile": []}
    compiled = {"s": 0.0, "n": 0}  # tracing, lowering and compiling, from jax's own events

    def on_event(event, duration, **kw):
        if event.startswith("/jax/core/compile/"):
            compiled["s"] += duration
            compiled["n"] += event.endswith("backend_compile_duration")

    jax.monitoring.register_event_duration_secs_listener(on_event)
    score = rl_loop.score

    def timed_score(*args, **kw):
        t = time.perf_counter()
        out = score(*args, **kw)
        spans["reward"].append(time.perf_counter() - t)
        return out

    rl_loop.score = timed_score
    sample = rl_loop.Rollouts.sample

    def counted_sample(self, *args):  # jax's compile time inside the engine's sampling
        c = compiled["s"]
        out = sample(self, *args)
        spans["sample_compile"].append(compiled["s"] - c)
        return out

    rl_loop.Rollouts.sample = counted_sample
    trainer = GRPOTrainer(cfg, a.workdir, log=lambda s: None)
    logps = trainer.logps

    def timed_logps(*args):
        t = time.perf_counter()
        out = jax.block_until_ready(logps(*args))
        spans["logps"].append(time.perf_counter() - t)
        return out

    trainer.logps = timed_logps
    rollout = trainer.rollout
    start = {"export_s": 0.0}
    batches: list[list[dict]] = []  # each rollout batch's examples, for the tunix child
    draw = rl_loop.examples

    def recorded_examples(task, n, *args, **kw):
        out = draw(task, n, *args, **kw)
        if n != cfg.train.batch_size:  # a rollout batch's prompts (the warm-up draws batch_size)
            batches.append([dict(prompt=e["prompt"], answer=e["answer"], format=e["format"])
                            for e in out])
        return out

    rl_loop.examples = recorded_examples

    def timed_rollout(state, *args):
        if a.export and not batches:  # the first RL batch: the policy after the warm-up
            t = time.perf_counter()
            export_start(trainer, state, a.export)
            start["export_s"] = time.perf_counter() - t
        t, c = time.perf_counter(), compiled["s"]
        out = rollout(state, *args)
        spans["prepare"].append(time.perf_counter() - t)
        spans["prepare_compile"].append(compiled["s"] - c)
        return out

    trainer.rollout = timed_rollout
    t0 = time.perf_counter()
    summary = trainer.train()
    wall = time.perf_counter() - t0 - start["export_s"]
    if a.export:
        with open(os.path.join(a.export, "prompts.jsonl"), "w") as f:
            for b in batches:
                f.write(json.dumps(b) + "\n")
    h = summary["history"]
    g = cfg.train.grpo
    sft = [r["update_s"] for r in h if "sft_loss" in r]
    rl = [r for r in h if "reward_mean" in r]
    k = g.num_iterations
    per_batch = [dict(rollout=rl[i]["rollout_s"], update=sum(r["update_s"] for r in rl[i:i + k]))
                 for i in range(0, len(rl), k)]
    n_lp = len(spans["logps"]) // max(len(per_batch), 1)
    for i, b in enumerate(per_batch):
        b["reward"] = spans["reward"][i]
        b["logps"] = sum(spans["logps"][i * n_lp:(i + 1) * n_lp])
        b["other"] = spans["prepare"][i] - b["rollout"] - b["reward"] - b["logps"]
        b["compile"] = spans["prepare_compile"][i]
        b["sample_compile"] = spans["sample_compile"][i]
    em = [r["rewards/exact_match"] for r in rl]
    for i, b in enumerate(per_batch):
        b["exact"] = em[i * k]
    return dict(per_batch=per_batch, sft=sft, wall=wall, compile_s=compiled["s"],
                export_s=start["export_s"], batches=len(batches),
                settings=dict(dataclasses.asdict(g), lr=cfg.train.lr, b1=cfg.train.b1,
                              b2=cfg.train.b2, grad_clip=cfg.train.grad_clip),
                compiles=compiled["n"], devices=devices or 1,
                prompts=cfg.train.batch_size // g.num_generations, n=g.num_generations,
                num_iterations=k, beta=g.beta, logps_per_batch=n_lp,
                exact_first=statistics.mean(em[:40]), exact_last=statistics.mean(em[-40:]))


def export_start(trainer, state, path: str) -> None:
    """The policy in `state` (a `GRPOTrainer`'s) as a Hugging Face Llama in `path`, with
    the run's tokenizer, and a probe: its logits on a few token rows (probe.npz), which
    the tunix child compares with its own load of the directory."""
    import jax
    import numpy as np
    from flax import nnx

    from tfjax.interop import hf

    p = trainer.program
    model = nnx.merge(p.eval_graphdef, state["params"], state["rest"])
    hf.export(model, path, tokenizer=trainer.tokenizer)
    tok = trainer.tokenizer
    rows = [[tok.bos_id] + list(tok.encode(f"{i}+{j}=")) + list(tok.encode(str(i + j)))
            for i, j in ((0, 0), (3, 4), (1, 5), (2, 6))]
    tokens = np.array(rows, np.int32)
    np.savez(os.path.join(path, "probe.npz"), tokens=tokens,
             logits=np.asarray(jax.device_get(model(tokens)), np.float32))


# ------------------------------------------------------------------ tunix's Llama3
def load_tunix_llama(path: str, devices: int, copies: int = 2):
    """`(cfg, mesh, models)`: tunix's Llama3 read `copies` times from the Hugging Face
    checkpoint `path` (float32) on a `devices` x 1 ("fsdp", "tp") mesh, for the tunix
    children (the policy and its reference); `bind_rope_theta(cfg)` before running them."""
    import jax
    import jax.numpy as jnp
    from tunix.models.llama3 import model as llama
    from tunix.models.llama3 import params as llama_params

    hf = json.load(open(os.path.join(path, "config.json")))
    rope = hf.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
    cfg = llama.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope.get("rope_theta", hf.get("rope_theta", 10000))),
        norm_eps=hf["rms_norm_eps"], weight_tying=hf.get("tie_word_embeddings", False))
    mesh = jax.make_mesh((devices, 1), ("fsdp", "tp"),  # tunix shards with Auto axes
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with mesh:
        models = [llama_params.create_model_from_safe_tensors(path, cfg, mesh,
                                                              dtype=jnp.float32)
                  for _ in range(copies)]
    return cfg, mesh, models


def bind_rope_theta(cfg) -> None:
    """tunix 0.1.7's Llama3 attention calls `apply_rope` without the config's
    `rope_theta` (so always its default, 1e6, whatever the checkpoint's): bind it."""
    from tunix.models.llama3 import model as llama

    llama.apply_rope = functools.partial(llama.apply_rope, rope_theta=cfg.rope_theta)


# ------------------------------------------------------------------ child: tunix DPO
def run_tunix(a) -> dict:
    """tunix's DPOTrainer on the same checkpoint (its Llama3 loaded from the safetensors)
    and the same pairs, run by the tunix venv's python: wall time of `train()` over
    `steps` steps after `warmup` (compile included there), the weights fetched after."""
    if a.devices > 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={a.devices}")
    from importlib.metadata import version

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tunix.sft.dpo import dpo_trainer as dpo

    hf = json.load(open(os.path.join(a.model, "config.json")))
    cfg, mesh, (policy, ref) = load_tunix_llama(a.model, a.devices)
    bind_rope_theta(cfg)
    with mesh:
        bos, eos = hf["bos_token_id"], hf["eos_token_id"]
        rows = [json.loads(line) for line in open(a.pairs)]

        def ids(text):
            return list(text.encode())

        batches = []
        for i in range(a.warmup + a.steps):
            chunk = rows[i * a.batch:(i + 1) * a.batch]
            prompt = np.array([[bos] + ids(r["prompt"]) for r in chunk], np.int32)
            chosen = np.array([ids(r["chosen"]) + [eos] for r in chunk], np.int32)
            rejected = np.array([ids(r["rejected"]) + [eos] for r in chunk], np.int32)
            batches.append(dpo.TrainingInput(
                prompt_ids=prompt, prompt_mask=np.ones_like(prompt), chosen_ids=chosen,
                chosen_mask=np.ones_like(chosen), rejected_ids=rejected,
                rejected_mask=np.ones_like(rejected)))
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(5e-7, weight_decay=0.0))
        tc = dpo.DPOTrainingConfig(eval_every_n_steps=10**9, max_steps=a.warmup, beta=0.1,
                                   algorithm="dpo", pbar_description=None)
        trainer = dpo.DPOTrainer(policy, ref, tx, tc)
        t = time.perf_counter()
        trainer.train(batches)
        jax.block_until_ready(nnx.state(policy))
        first = time.perf_counter() - t
        trainer.config.max_steps = a.warmup + a.steps
        t = time.perf_counter()
        trainer.train(batches)  # skips the batches already trained
        jax.block_until_ready(nnx.state(policy))
        timed = time.perf_counter() - t
        done = trainer._train_steps
    return dict(first=first, timed=timed, steps=done - a.warmup, lens=(
        prompt.shape[1], chosen.shape[1], rejected.shape[1]), devices=a.devices,
        tunix=version("google-tunix"), jax=jax.__version__)


# ------------------------------------------------------------------ child: tunix GRPO
def run_tunix_grpo(a) -> dict:
    """tunix's GRPOLearner (its RLCluster, vanilla rollout = its Sampler) on the tfjax
    tiny run's starting policy (`--model`, exported by the grpo child after its
    warm-up) and its rollout batches' prompts (`--prompts`), with tfjax's reward
    functions, run by the tunix venv's python: per rollout batch the sampling, the
    rewards, the reference / old log-probs and the `num_iterations` updates, timed."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={a.devices}")
    from importlib.metadata import version

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from flax import nnx
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.grpo import grpo_learner as grpo
    from tunix.rl.rollout import base_rollout

    from tfjax.train.rl.rewards import REWARDS  # tfjax's own functions: the same rewards

    g = json.loads(a.grpo)  # the tfjax run's settings (the parent passes them)
    hf = json.load(open(os.path.join(a.model, "config.json")))
    batches = [json.loads(line) for line in open(a.prompts)][:a.steps]
    compiled = {"s": 0.0}

    def on_event(event, duration, **kw):
        if event.startswith("/jax/core/compile/"):
            compiled["s"] += duration

    jax.monitoring.register_event_duration_secs_listener(on_event)
    cfg, mesh, (policy, reference) = load_tunix_llama(a.model, a.devices)
    probe = np.load(os.path.join(a.model, "probe.npz"))
    tokens = jnp.asarray(probe["tokens"])
    T = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (tokens.shape[0], T, T))

    def probe_diff():  # max |logit difference| against tfjax's on the probe rows
        with mesh:
            logits, _ = policy(tokens, positions, None, causal)
        return float(np.abs(np.asarray(logits) - probe["logits"]).max())

    unpatched = probe_diff()
    bind_rope_theta(cfg)
    patched = probe_diff()
    tok = transformers.AutoTokenizer.from_pretrained(a.model)

    rollout_cfg = base_rollout.RolloutConfig(
        max_tokens_to_generate=g["max_completion_length"], temperature=g["temperature"],
        top_p=g["top_p"], top_k=g["top_k"] or None, max_prompt_length=g["max_prompt_length"],
        kv_cache_size=g["max_prompt_length"] + g["max_completion_length"],
        eos_tokens=[hf["eos_token_id"]])
    tx = optax.chain(optax.clip_by_global_norm(g["grad_clip"]),
                     optax.adamw(g["lr"], b1=g["b1"], b2=g["b2"], weight_decay=0.0))
    cluster = rlc.RLCluster(
        actor=policy, reference=reference, tokenizer=tok,
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh,
                          rlc.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, rollout_config=rollout_cfg,
            training_config=rlc.RLTrainingConfig(
                actor_optimizer=tx, eval_every_n_steps=10**9,
                max_steps=len(batches) * g["num_iterations"], pbar_description=None)))
    algo = grpo.GRPOConfig(num_generations=g["num_generations"],
                           num_iterations=g["num_iterations"], beta=g["beta"],
                           epsilon=g["epsilon"], loss_agg_mode="token-mean",
                           kl_loss_mode="low_var_kl")
    exact: list[float] = []
    weights = dict(zip(g["reward_funcs"], g["reward_weights"] or [1.0] * len(g["reward_funcs"])))

    def reward(name):
        fn = REWARDS.get(name)

        def rate(prompts, completions, answer, format, **kw):  # noqa: A002 (the key)
            got = [fn(p, c, dict(answer=str(x), format=str(f)))
                   for p, c, x, f in zip(prompts, completions, answer, format)]
            if name == "exact_match":
                exact.append(float(np.mean(got)))
            return [weights[name] * r for r in got]

        rate.__name__ = name
        return rate

    learner = grpo.GRPOLearner(rl_cluster=cluster, algo_config=algo,
                               reward_fns=[reward(n) for n in g["reward_funcs"]])
    spans = {k: [] for k in ("rollout", "reward", "logps", "prepare", "update",
                              "rollout_compile")}

    def timed(obj, name, key, block=False):
        fn = getattr(obj, name)

        def wrapper(*args, **kw):
            t, c = time.perf_counter(), compiled["s"]
            out = fn(*args, **kw)
            if block:
                jax.block_until_ready(out)
            spans[key].append(time.perf_counter() - t)
            if key == "rollout":
                spans["rollout_compile"].append(compiled["s"] - c)
            return out

        setattr(obj, name, wrapper)

    generate = cluster.generate

    def seeded_generate(*args, **kw):  # a new sampling seed each batch (tunix's: fixed)
        rollout_cfg.seed = len(spans["rollout"])
        return generate(*args, **kw)

    cluster.generate = seeded_generate
    timed(cluster, "generate", "rollout")
    timed(cluster, "get_ref_per_token_logps", "logps", block=True)
    timed(cluster, "get_old_per_token_logps", "logps", block=True)
    timed(learner, "_compute_rewards", "reward")
    timed(learner, "_generate_and_compute_advantage", "prepare", block=True)
    update_actor = cluster.update_actor

    def timed_update(*args, **kw):
        t = time.perf_counter()
        update_actor(*args, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        spans["update"].append(time.perf_counter() - t)

    cluster.update_actor = timed_update
    data = [dict(prompts=np.array([e["prompt"] for e in b]),
                 answer=np.array([e["answer"] for e in b]),
                 format=np.array([e["format"] for e in b])) for b in batches]
    t = time.perf_counter()
    learner.train(data)
    wall = time.perf_counter() - t
    k = g["num_iterations"]
    n = len(spans["prepare"])
    n_lp = len(spans["logps"]) // max(n, 1)
    per_batch = []
    for i in range(n):
        b = dict(rollout=spans["rollout"][i], reward=spans["reward"][i],
                 logps=sum(spans["logps"][i * n_lp:(i + 1) * n_lp]),
                 update=sum(spans["update"][i * k:(i + 1) * k]),
                 sample_compile=spans["rollout_compile"][i], exact=exact[i])
        b["other"] = spans["prepare"][i] - b["rollout"] - b["reward"] - b["logps"]
        per_batch.append(b)
    return dict(per_batch=per_batch, wall=wall, compile_s=compiled["s"], probe_diff=patched,
                probe_diff_unpatched=unpatched, rope_theta=cfg.rope_theta,
                logps_per_batch=n_lp, updates=cluster.actor_trainer.train_steps,
                devices=a.devices, tunix=version("google-tunix"), jax=jax.__version__)


# ------------------------------------------------------------------ parent
def child(part: str, argv: list[str], timeout: int, python: str = sys.executable) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [python, os.path.abspath(__file__), "--part", part, "--result", out.name,
               *argv]
        env = dict(os.environ, PYTHONPATH=ROOT)
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{part} failed ({p.returncode}):\n{p.stderr[-4000:]}")
        return json.load(open(out.name))


def tfjax_dpo(model: str, pairs: str, workdir: str, batch: int, seq_len: int, steps: int,
              warmup: int, cpu_devices: int, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "tfjax.train", "--config", "configs/dpo.py",
           "--workdir", workdir, f"--cpu_devices={cpu_devices}",
           f"--config.init_from={model}", f"--config.data.paths=('{pairs}',)",
           f"--config.data.val_paths=('{pairs}',)",
           f"--config.train.steps={warmup + steps + 1}", f"--config.train.batch_size={batch}",
           f"--config.train.seq_len={seq_len}", "--config.train.log_every=1",
           "--config.train.eval_every=0", "--config.train.eval_at_end=False",
           "--config.train.progress=False", "--config.checkpoint.enabled=False",
           "--config.train.warmup_steps=0", "--config.train.schedule=constant"]
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"tfjax DPO failed ({p.returncode}):\n{p.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    timed = [r for r in rows if "step_time_s" in r][warmup:]
    return dict(times=[r["step_time_s"] for r in timed], wall=wall,
                compile_s=sum(r.get("time_compile_s", 0.0) for r in rows),
                tokens_per_step=timed[0]["tokens_per_s"] * timed[0]["step_time_s"],
                acc=rows[-1].get("rewards/accuracies"))


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def grpo_against_tunix(exp: Experiment, g: dict, tg: dict) -> None:
    """The table of tfjax's and tunix's GRPO rollout batches side by side, and its notes."""
    ours, theirs = g["per_batch"], tg["per_batch"]
    skip = 3 if min(len(ours), len(theirs)) > 6 else 1
    keys = ("rollout", "reward", "logps", "update", "other")
    names = {"rollout": "rollout (sampling; to text)", "reward": "rewards (tfjax's functions)",
             "logps": "old + reference log-probs", "update": "updates",
             "other": "the rest (advantages, batch layout)"}
    rows = []
    for key in (*keys, "total"):
        ms = [1000 * statistics.median(sum(b[k] for k in keys) if key == "total" else b[key]
                                       for b in run[skip:]) for run in (ours, theirs)]
        rows.append([names.get(key, "total"), ms[0], ms[1], ms[1] / ms[0]])
    n = min(20, len(ours) // 2, len(theirs) // 2) or 1
    for label, run in (("tfjax", ours), ("google-tunix", theirs)):
        first = statistics.mean(b["exact"] for b in run[:n])
        last = statistics.mean(b["exact"] for b in run[-n:])
        rows.append([f"exact match, {label}: batch 1 (the start); first {n} batches -> last {n}",
                     f"{run[0]['exact']:.2f}; {first:.2f} -> {last:.2f}", "", ""])
    exp.table(["per rollout batch", "tfjax ms (median after %d)" % skip,
               "google-tunix %s ms (median after %d)" % (tg["tunix"], skip), "tunix / tfjax"],
              rows, title=f"GRPO tiny task, tfjax and google-tunix side by side: "
                          f"{len(ours)} / {len(theirs)} rollout batches of {g['prompts']} "
                          f"prompts x {g['n']} completions, {g['devices']} CPU devices each")
    s = g["settings"]
    exp.text(
        f"google-tunix {tg['tunix']} (jax {tg['jax']}, its own venv): `GRPOLearner` with an "
        f"`RLCluster` (actor, reference and rollout on one {tg['devices']}-device (fsdp, tp) "
        f"mesh, so the sampler shares the actor's weights: no weight sync) and the vanilla "
        f"rollout (tunix's `Sampler`, KV cache of {s['max_prompt_length']} + "
        f"{s['max_completion_length']} tokens). The model: tfjax's tiny preset model after "
        f"its {s['sft_steps']} supervised warm-up steps, exported by `tfjax.interop.hf.export` "
        f"as a Llama and loaded into tunix's Llama3 (float32, tied embeddings), the "
        f"reference a second load. tunix 0.1.7's Llama3 attention calls `apply_rope` "
        f"without the config's `rope_theta` (so always its default 1e6); the child binds "
        f"the checkpoint's ({tg['rope_theta']}) to it: max |logit difference| against "
        f"tfjax's on 4 probe rows {tg['probe_diff']:.1e} with it, "
        f"{tg['probe_diff_unpatched']:.1e} without (a different starting policy). "
        f"The prompts: the {len(ours)} rollout batches tfjax drew, "
        f"in its order; the rewards: tfjax's `exact_match` + {s['reward_weights'][1]} x "
        f"`format`. The same settings: {s['num_generations']} generations, num_iterations "
        f"{s['num_iterations']}, beta {s['beta']}, epsilon {s['epsilon']}, temperature "
        f"{s['temperature']}, at most {s['max_completion_length']} completion tokens, "
        f"token-mean loss (tfjax's \"dapo\"), AdamW lr {s['lr']} (b1 {s['b1']}, b2 "
        f"{s['b2']}), clip {s['grad_clip']}. Where they differ: tunix's KL is k3 "
        f"(\"low_var_kl\") without tfjax's ratio factor (`use_bias_correction_kl`), its "
        f"advantages divide by std + 1e-6 (tfjax 1e-4), its completions stop before EOS "
        f"(no EOS token trained; tfjax keeps it, as TRL), its prompts are left-padded to "
        f"{s['max_prompt_length']}, and its optimizer starts fresh at the first RL step "
        f"(tfjax's AdamW state continues from the warm-up). tunix's rollout seed is one "
        f"config value; the child sets it to the batch's index before each rollout. Timed "
        f"by wrapping `RLCluster.generate`, the reward and log-prob calls and "
        f"`update_actor` (each blocked until its arrays are ready). Whole `train()`: tfjax "
        f"{g['wall']:.0f} s (its warm-up included), tunix {tg['wall']:.0f} s ({tg['updates']} "
        f"updates; jax compiled for {tg['compile_s']:.1f} s in the whole process, model "
        f"loading included, {sum(b['sample_compile'] for b in theirs):.1f} s of it inside "
        f"rollouts); "
        f"first rollout batch (compiles): tfjax "
        f"{sum(ours[0][k] for k in keys):.1f} s, tunix {sum(theirs[0][k] for k in keys):.1f} s.")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--part", choices=("trl", "grpo", "tunix", "tunix_grpo"),
                   help=argparse.SUPPRESS)
    p.add_argument("--grpo", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    for name in ("model", "pairs", "workdir", "export", "prompts"):
        p.add_argument("--" + name, help=argparse.SUPPRESS)
    for name in ("batch", "steps", "warmup", "devices", "threads"):
        p.add_argument("--" + name, type=int, help=argparse.SUPPRESS)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: dpo, grpo")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating rounds of the DPO systems (default 2; --quick 1)")
    p.add_argument("--tunix-python", default="",
                   help="python of a separate venv with google-tunix: time its DPOTrainer "
                        "and its GRPOLearner too")
    if "--part" in (argv if argv is not None else sys.argv):  # a child: its part, then exit
        a, _ = p.parse_known_args(argv)
        a.quick = "--quick" in (argv if argv is not None else sys.argv)
        out = dict(trl=run_trl, grpo=run_grpo, tunix=run_tunix,
                   tunix_grpo=run_tunix_grpo)[a.part](a)
        with open(a.result, "w") as f:
            json.dump(out, f)
        return
    exp = Experiment("posttrain_cpu", __doc__, parser=p, argv=argv)
    skip = set(filter(None, exp.args.skip.split(",")))
    q = exp.quick
    exp.args.rounds = exp.args.rounds or (1 if q else 2)
    exp.text(f"Load average (1/5/15 min) at the start: {load()} on {os.cpu_count()} cores.")
    if "dpo" not in skip:
        shape = dict(layers=2, d=64, heads=4, d_ff=172) if q else \
            dict(layers=4, d=256, heads=4, d_ff=688)
        batch, steps, warmup = (2, 2, 1) if q else (8, 10, 3)
        prompt_len, response_len = (30, 30) if q else (62, 62)
        seq = 1 + prompt_len + response_len + 1  # [bos] prompt response [eos]
        seq_len = 2 * seq + (4 if q else 4)  # one pair (two sequences) a row
        with tempfile.TemporaryDirectory() as tmp:
            model, pairs = os.path.join(tmp, "llama"), os.path.join(tmp, "pairs.jsonl")
            make_model(model, max_len=512, **shape)
            make_pairs(pairs, 4 * batch * (warmup + steps + 2), prompt_len, response_len)
            common = ["--model", model, "--pairs", pairs, "--batch", str(batch),
                      "--steps", str(steps), "--warmup", str(warmup)]
            # Alternating rounds: the machine is shared, so each ratio is taken within a round.
            runs: dict[str, list[dict]] = {}
            tunix_error = None
            loads = []
            for r in range(exp.args.rounds):
                w = os.path.join(tmp, f"r{r}")
                loads.append(load())
                for th in (os.cpu_count(), 1):
                    runs.setdefault(f"trl{th}", []).append(child(
                        "trl", common + ["--workdir", w + f"trl{th}", "--threads", str(th)], 600))
                for n in (-1, 1):
                    runs.setdefault(f"tfjax{n}", []).append(tfjax_dpo(
                        model, pairs, w + f"tfjax{n}", batch, seq_len, steps, warmup, n, 600))
                if exp.args.tunix_python and tunix_error is None:
                    try:
                        runs.setdefault("tunix", []).append(child(
                            "tunix", common + ["--devices", "2"], 600,
                            python=exp.args.tunix_python))
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        tunix_error = str(e)[-1500:]
        for o in runs.get("tunix", []):  # no per-step times: the mean over the timed steps
            o["times"] = [o["timed"] / o["steps"]]
        trl_out = runs[f"trl{os.cpu_count()}"][0]
        ours, ours1 = runs["tfjax-1"][0], runs["tfjax1"][0]
        tunix = runs.get("tunix", [])
        # the faster TRL of the round: torch's threads can lose badly on a shared machine
        base = [min(statistics.median(a["times"]), statistics.median(b["times"]))
                for a, b in zip(runs[f"trl{os.cpu_count()}"], runs["trl1"])]
        labels = {f"trl{os.cpu_count()}": f"TRL {trl_out['trl']} DPOTrainer (torch "
                                          f"{trl_out['torch']}, {os.cpu_count()} threads)",
                  "trl1": f"TRL {trl_out['trl']} DPOTrainer (torch {trl_out['torch']}, 1 thread)",
                  "tfjax-1": "tfjax configs/dpo.py (2 CPU devices, data-parallel: the default)",
                  "tfjax1": "tfjax configs/dpo.py (--cpu_devices=1)",
                  "tunix": "google-tunix %s DPOTrainer (jax %s, 2 CPU devices, fsdp; mean)" % (
                      tunix[0]["tunix"], tunix[0]["jax"]) if tunix else ""}
        rows = []
        for key, label in labels.items():
            if key not in runs:
                continue
            meds = [statistics.median(o["times"]) for o in runs[key]]
            rows.append([label, " / ".join(f"{1000 * m:.0f}" for m in meds),
                         1000 * min(min(o["times"]) for o in runs[key]),
                         " / ".join(f"{batch / m:.2f}" for m in meds),
                         " / ".join(f"{m / b:.3f}" for m, b in zip(meds, base))])
        exp.table(["system", "step ms (median; round 1 / 2 ...)", "step ms (min, all rounds)",
                   "pairs/s", "step time / TRL's faster (same round)"], rows,
                  title=f"DPO step, {shape['layers']} layers d {shape['d']} float32 Llama, "
                        f"{batch} pairs a step, {steps} timed steps after {warmup} warm-up, "
                        f"{exp.args.rounds} alternating rounds")
        exp.text(
            f"Each pair: prompt {trl_out['lens'][0]} tokens ([bos] + {prompt_len} bytes), chosen "
            f"and rejected {trl_out['lens'][1]} / {trl_out['lens'][2]} tokens ({response_len} "
            f"bytes + [eos]) as TRL tokenized them. TRL's step: one batch of {2 * batch} "
            f"sequences x {sum(trl_out['lens'][:2])} tokens (chosen then rejected, right-padded; "
            f"every pair the same length, so no padding), policy forward + backward and a "
            f"reference forward (reference: {trl_out['ref']}, a copy of the policy). tfjax's "
            f"step: {batch} rows x {seq_len} tokens, one whole pair (two sequences, "
            f"{2 * seq} tokens, segment ids apart) packed in each row and {seq_len - 2 * seq} "
            f"padding tokens, policy forward + backward and the frozen reference copy's "
            f"forward, one jitted step. Both AdamW, grad clip 1.0, float32. tfjax compile "
            f"(first step): {ours['compile_s']:.1f} s (2 devices), {ours1['compile_s']:.1f} s "
            f"(1 device); wall of the whole tfjax run {ours['wall']:.0f} s / {ours1['wall']:.0f} s."
            f" Load average (1/5/15) at each round's start: {'; '.join(loads)}."
            f" Round 1's step times: TRL "
            f"{', '.join(f'{1000 * x:.0f}' for x in trl_out['times'])} ms; "
            f"tfjax {', '.join(f'{1000 * x:.0f}' for x in ours['times'])} ms / "
            f"{', '.join(f'{1000 * x:.0f}' for x in ours1['times'])} ms.")
        if tunix:
            exp.text(
                f"google-tunix: its DPOTrainer (tunix.sft.dpo, beta 0.1, sigmoid loss) on its "
                f"Llama3 loaded from the same safetensors (float32), the reference a second "
                f"load of them; the same pairs as token ids ([bos] + prompt "
                f"{tunix[0]['lens'][0]} tokens, chosen / rejected {tunix[0]['lens'][1]} / "
                f"{tunix[0]['lens'][2]} with [eos]), {2 * batch} sequences of "
                f"{tunix[0]['lens'][0] + tunix[0]['lens'][1]} tokens a step as TRL; optax "
                f"clip 1.0 + AdamW. Timed as the wall time of `train()` over {steps} steps "
                f"after {warmup} (its loop dispatches ahead, so no per-step times), weights "
                f"fetched at the end: the mean. First {warmup} steps incl. compile: "
                + ", ".join(f"{o['first']:.1f} s" for o in tunix)
                + ". Installed with `pip install google-tunix` into a separate python 3.11 "
                  "venv.")
        if tunix_error:
            exp.text(f"google-tunix did not run:\n\n```\n{tunix_error}\n```")
    if "grpo" not in skip:
        tg, tunix_grpo_error = None, None
        with tempfile.TemporaryDirectory() as tmp:
            start = os.path.join(tmp, "start")  # the policy after the warm-up, for tunix
            g = child("grpo", ["--workdir", os.path.join(tmp, "w")]
                      + (["--export", start] if exp.args.tunix_python else [])
                      + (["--quick"] if q else []), 900)
            if exp.args.tunix_python:
                try:
                    tg = child("tunix_grpo", [
                        "--model", start, "--prompts", os.path.join(start, "prompts.jsonl"),
                        "--steps", str(g["batches"]), "--devices", str(g["devices"]),
                        "--grpo", json.dumps(g["settings"])], 600,
                        python=exp.args.tunix_python)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    tunix_grpo_error = str(e)[-1500:]
        pb = g["per_batch"]
        steady = pb[3:] if len(pb) > 6 else pb[1:]
        keys = ("rollout", "reward", "logps", "update", "other")
        names = {"rollout": "rollout (the engine samples; incl. set_params, decode to text)",
                 "reward": "rewards (Python functions)",
                 "logps": f"old + reference log-probs ({g['logps_per_batch']} forwards)",
                 "update": f"updates ({g['num_iterations']} optimizer steps)",
                 "other": "the rest of the batch (advantages, device_put)"}
        total_all = {k: sum(b[k] for b in pb) for k in keys}
        med = {k: statistics.median(b[k] for b in steady) for k in keys}
        tot_med = sum(med.values())
        tot_all = sum(total_all.values())
        rows = [[names[k], 1000 * med[k], 100 * med[k] / tot_med, total_all[k],
                 100 * total_all[k] / tot_all] for k in keys]
        rows.append(["total", 1000 * tot_med, 100.0, tot_all, 100.0])
        exp.table(["part of a rollout batch", "ms (median, after 3 batches)", "share %",
                   "s over the run (incl. compiles)", "share of run %"], rows,
                  title=f"GRPO tiny preset: {len(pb)} rollout batches of {g['prompts']} prompts "
                        f"x {g['n']} completions, {g['devices']} CPU device(s)")
        exp.text(
            f"configs/grpo.py:tiny (checkpoints off), in one process with timers around the "
            f"rollout batch's parts; `update_s` is the trainer's own. Supervised warm-up: "
            f"{len(g['sft'])} steps, {sum(g['sft']):.1f} s (incl. compile). Whole train(): "
            f"{g['wall']:.0f} s. Exact match, first 40 RL steps -> last 40: "
            f"{g['exact_first']:.2f} -> {g['exact_last']:.2f}.")
        slow = [b for b in pb if b["rollout"] > 4 * med["rollout"]]
        exp.text(
            f"The run's mean rollout ({1000 * total_all['rollout'] / len(pb):.0f} ms) is far "
            f"above its median: {len(slow)} of {len(pb)} rollout batches took over 4x the "
            f"median ({sum(b['rollout'] for b in slow):.1f} s together). jax reported "
            f"{sum(b['sample_compile'] for b in pb):.1f} s of tracing / lowering / compiling "
            f"inside the engine's sampling ({sum(b['sample_compile'] for b in slow):.1f} s of "
            f"it in those {len(slow)} batches), {sum(b['compile'] for b in pb):.1f} s inside "
            f"the rollout batches' whole preparation (sampling, rewards, log-probs); in the "
            f"whole process {g['compile_s']:.1f} s over {g['compiles']} XLA compiles.")
        if tg:
            grpo_against_tunix(exp, g, tg)
        if tunix_grpo_error:
            exp.text(f"google-tunix's GRPO did not run:\n\n```\n{tunix_grpo_error}\n```")
    exp.text(f"Load average (1/5/15 min) at the end: {load()}.")
    exp.finish()


if __name__ == "__main__":
    main()
