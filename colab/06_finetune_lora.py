# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · Fine-tune a checkpoint with LoRA, evaluate before and after
#
# The research loop of tfjax on one page: a Hugging Face checkpoint (here one we make,
# so the notebook runs offline: a tiny byte-level decoder pretrained on the Python
# standard library and written out by `tfjax.export`; set `BASE_HF` to the directory of
# any Llama-family checkpoint instead) is fine-tuned with LoRA (`tfjax.train.lora`: the
# base weights frozen, rank-r adapters trained) on instruction data (jsonl lines with
# `prompt` and `completion`, the loss on the completions only), then evaluated before
# and after with `tfjax.eval` (the perplexity `python -m tfjax.eval` computes) and by
# greedy generation, and the curves are plotted from the run's `metrics.jsonl`.
#
# `QUICK = True` (the default, about a minute on a laptop CPU) pretrains the base for
# 300 steps and fine-tunes for 150.

# %%
QUICK = True
BASE_HF = None  # or the directory of a Llama-family HF checkpoint (config.json, *.safetensors, tokenizer.json)

# %%
# Setup. In Colab: clone the repository (the package and its configs/) and install it.
import os
import subprocess
import sys
from pathlib import Path

if "google.colab" in sys.modules:
    if not Path("tfjax-repo").exists():
        subprocess.run(["git", "clone", "--depth=1", "https://github.com/tfjax/tfjax",
                        "tfjax-repo"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "./tfjax-repo"], check=True)
    os.chdir("tfjax-repo")
# Work from the repository root: the presets in configs/ are code.
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "configs").is_dir())
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

# %%
import json
import random
import tempfile

import jax
import matplotlib.pyplot as plt
import numpy as np

from configs import default, finetune
from tfjax.config import run_config
from tfjax.eval import Scorer, evaluate, load_source, summarize
from tfjax.export import export_run
from tfjax.inference import generate
from tfjax.train import Trainer

work = Path(tempfile.mkdtemp(prefix="tfjax_nb06_"))

# %% [markdown]
# ## The base checkpoint
#
# Unless `BASE_HF` names one: `configs/default.py:tiny` (2 layers, d=64, Llama-style)
# trained on the stdlib bytes, then `export_run` (what `python -m tfjax.export
# --workdir W --out DIR` runs) writes it as a Hugging Face checkpoint with its
# tokenizer, which `transformers.AutoModelForCausalLM.from_pretrained` reads.

# %%
if BASE_HF is None:
    cfg = default.get_config("tiny")
    cfg.train.update(steps=300 if QUICK else 1500, batch_size=16, seq_len=128, lr=5e-3,
                     warmup_steps=20, log_every=50, sample_tokens=0, progress=False,
                     eval_at_end=False)
    cfg.checkpoint.update(every_steps=0, keep=1)
    cfg.mesh.data = -1
    Trainer(run_config(cfg), str(work / "base")).train()
    BASE_HF = str(work / "base_hf")
    export_run(str(work / "base"), BASE_HF)
print(sorted(os.listdir(BASE_HF)))

# %% [markdown]
# ## Instruction data
#
# A task the base has never seen: write a word in capitals. Each jsonl line is
# `{"prompt": ..., "completion": ...}`; the trainer lays a line out as
# `[bos] + prompt + completion + [eos]`, packs lines into rows with document
# boundaries, and scores only the completion's tokens (`data.format="instruction"`).

# %%
random.seed(0)
letters = "abcdefghijklmnopqrstuvwxyz"


def example():
    word = "".join(random.choice(letters) for _ in range(random.randint(3, 7)))
    return {"prompt": f"lower: {word}\nupper:", "completion": f" {word.upper()}\n"}


for split, n in (("train", 2000), ("val", 200)):
    with open(work / f"{split}.jsonl", "w") as f:
        for _ in range(n):
            f.write(json.dumps(example()) + "\n")
print(open(work / "train.jsonl").readline())

# %% [markdown]
# ## LoRA fine-tuning
#
# `configs/finetune.py` (instruction jsonl, the checkpoint's tokenizer) with
# `init_from` the base and LoRA of rank 8 on every attention and FFN matrix
# (`lora.targets="all"`): the optimizer sees only the adapters. B starts at zero, so
# before the first step the model is the base: its validation loss on the completions
# is the "before" number.

# %%
cfg = finetune.get_config()
cfg.init_from = BASE_HF
cfg.data.update(paths=(str(work / "train.jsonl"),), val_paths=(str(work / "val.jsonl"),))
cfg.lora.update(rank=8, alpha=16.0, targets="all")
cfg.train.update(steps=150 if QUICK else 600, batch_size=16, seq_len=128, lr=3e-3,
                 warmup_steps=10, weight_decay=0.0, log_every=10, eval_every=50,
                 eval_batches=4, progress=False)
cfg.checkpoint.update(every_steps=0, keep=1)
cfg.mesh.data = -1
run = run_config(cfg)
trainer = Trainer(run, str(work / "lora"))
start = trainer.init_state()  # what training starts from: the base, adapters B = 0
before = trainer.evaluate(start)
n_base = sum(x.size for x in jax.tree.leaves(start["frozen"]))
n_lora = sum(x.size for x in jax.tree.leaves(start["params"]))
del start
print(f"trainable: {n_lora:,} adapter parameters; frozen: {n_base:,} base parameters")
summary = trainer.train()
print(f"validation loss on the completions: {before['val_loss']:.3f} -> "
      f"{summary['val_loss']:.3f} nats / token")

# %% [markdown]
# ## Evaluate before and after
#
# The fine-tuned run exported merged (each adapted matrix W + (alpha / r) A B, every
# other tensor the base's own), then both checkpoints through `tfjax.eval`'s `Scorer`
# (the per-token log-probabilities `python -m tfjax.eval` sums): the NLL of the
# held-out completions given their prompts, the perplexity of the whole lines
# (prompt and completion: what `python -m tfjax.eval --data val.jsonl` reports for
# `{"text": ...}` lines), and greedy answers through the KV-cached `generate`.

# %%
export_run(str(work / "lora"), str(work / "lora_hf"))
held_out = [json.loads(line) for line in open(work / "val.jsonl")][:64]
results = {}
for name, path in (("base", BASE_HF), ("LoRA fine-tuned", str(work / "lora_hf"))):
    src = load_source(hf=path)
    scorer = Scorer(src.model, batch_size=16)
    texts = [d["prompt"] + d["completion"] for d in held_out]
    rows = [np.asarray(src.encode(t, True)) for t in texts]
    out = evaluate(scorer, rows, context=128)
    results[name] = summarize(out["nll_sum"], out["tokens"],
                              sum(len(t.encode()) for t in texts))
    # the completions alone: their tokens' log-probabilities given the prompt
    T = max(map(len, rows))
    tokens, targets = np.zeros((len(rows), T), np.int32), np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r) - 1], targets[i, :len(r) - 1] = r[:-1], r[1:]
    logp = np.concatenate([scorer(tokens[b:b + 16], targets[b:b + 16])[0]
                           for b in range(0, len(rows), 16)])
    n_done = [len(src.encode(d["completion"], False)) for d in held_out]
    results[name]["completion nll"] = -np.mean(np.concatenate(
        [logp[i, len(r) - 1 - k:len(r) - 1] for i, (r, k) in enumerate(zip(rows, n_done))]))
    prompts = [src.encode(d["prompt"], True) for d in held_out[:16]]
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    new = np.asarray(generate(src.model, ids, max_new_tokens=10,
                              prompt_lengths=np.array([len(p) for p in prompts]),
                              eos_id=src.eos_ids[0]))
    answers = [src.decode([t for t in row if t != src.eos_ids[0]]).split("\n")[0]
               for row in new.tolist()]
    exact = np.mean([a == d["completion"].rstrip("\n") for a, d in zip(answers, held_out)])
    results[name]["exact match"] = float(exact)
    print(f"{name}: {held_out[0]['prompt']!r} -> {answers[0]!r}, {answers[1]!r}, {answers[2]!r}")
for name, r in results.items():
    print(f"{name:>16}: completions {r['completion nll']:.3f} nats/token; whole lines: "
          f"perplexity {r['perplexity']:.2f}, {r['bits_per_byte']:.3f} bits/byte; greedy exact "
          f"match {100 * r['exact match']:.0f}%")

# %% [markdown]
# The completions' NLL falls as the validation loss did. The whole lines' perplexity
# need not, and here it rises: the adapters were trained on the completions only, and
# the prompts are random lowercase letters, which a model that has learned to expect
# capitals after "upper:" is likely to predict worse than the base did.
# At this size (0.12M parameters, a few hundred steps) the fine-tuned model learns the
# format (capitals, then a newline) before it learns to copy the word.

# %% [markdown]
# ## The curves
#
# From the fine-tune's `metrics.jsonl`: the training loss (completion tokens only) per
# logged step and the validation loss at each evaluation, starting from the base's.

# %%
records = [json.loads(line) for line in open(work / "lora" / "metrics.jsonl")]
train_recs = [r for r in records if "loss" in r]
val_recs = [r for r in records if "val_loss" in r]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["step"] for r in train_recs], [r["loss"] for r in train_recs], "o-", ms=3,
        label="train (completions)")
ax.plot([0] + [r["step"] for r in val_recs], [before["val_loss"]] + [r["val_loss"] for r in val_recs],
        "r*-", ms=9, label="validation (completions)")
ax.set(xlabel="step", ylabel="loss (nats / token)", title="LoRA fine-tuning")
ax.legend()
fig.tight_layout()
plt.show()
