"""Preference and distillation losses against TRL 1.16 on one tiny random Hugging Face
Llama (policy) and another (reference / teacher), both loaded into tfjax with the interop
loader, in float32: TRL's own code (`DPOTrainer._compute_loss` with its fused LM head,
`CPOTrainer.cpo_loss`, `ORPOTrainer.odds_ratio_loss`, `GKDTrainer.generalized_jsd_loss`)
fed with log-probs / logits from the torch models, against tfjax's losses on the same
pairs packed several to a row. Within 1e-5."""

from __future__ import annotations

import collections
import types

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_hf import save_tiny_llama

from tfjax.config import PreferenceConfig
from tfjax.data.pairs import encode_pairs, pair_row
from tfjax.data.tokenizer import ByteTokenizer
from tfjax.interop import hf
from tfjax.train.distill import generalized_jsd
from tfjax.train.objectives import preference_report
from tfjax.train.preference import pair_sums

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

PAIRS = [dict(prompt="copy apple:", chosen=" apple", rejected=" a river, or stone"),
         dict(prompt="Q: 2+2?", chosen=" 4", rejected=" five"),
         dict(prompt="Name a colour:", chosen=" blue, or perhaps green", rejected=" cat")]
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _llama(path, seed):
    # larger weights: log-ratios well away from 0
    return save_tiny_llama(path, seed=seed, weight_scale=4.0, tokenizer=None,
                           max_position_embeddings=128)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy, reference) as (torch, tfjax) pairs."""
    out = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"llama{seed}")
        theirs = _llama(path, seed)
        ours, _ = hf.load(str(path), dtype="float32")
        out.append((theirs, ours))
    return out


def _packed():
    """The pairs packed: pairs 0 and 1 in row 0, pair 2 in row 1."""
    tok = ByteTokenizer()
    enc = encode_pairs(PAIRS, tok, 96)
    rows = [pair_row(enc[:2], 96, tok), pair_row(enc[2:], 96, tok)]
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}, enc


def _hf_batch(enc):
    """TRL's layout: the chosen sequences, then the rejected, right-padded; completion
    mask on the responses and their EOS."""
    seqs = [p["seqs"][0] for p in enc] + [p["seqs"][1] for p in enc]
    L = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    att, comp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (x, scored) in enumerate(seqs):
        ids[i, :len(x)] = torch.tensor(x)
        att[i, :len(x)] = 1
        comp[i, :len(x)] = torch.tensor(scored)
    return dict(input_ids=ids, attention_mask=att, completion_mask=comp)


def _logps(model, batch, average):
    """Per-sequence response log-probs from the torch model, through TRL's get_batch_logps."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average), logits


def _ours(kind, cfg, models, reference=True):
    b, _ = _packed()
    sums = pair_sums(kind, cfg, models[0][1], b, models[1][1] if reference else None)
    sums = {k: float(v) for k, v in sums.items()}
    loss = sums["nll"] / sums["tokens"]
    if kind == "orpo":
        loss += sums["sft_nll"] / sums["sft_tokens"]
    return loss, preference_report(sums), sums


def _close(ours, theirs):
    assert abs(ours - float(theirs)) <= TOL, (ours, float(theirs))


@pytest.mark.parametrize("kind", ["dpo", "ipo"])
def test_dpo_ipo_equal_trl_dpo_trainer(models, kind):
    """TRL's DPOTrainer._compute_loss (loss_type sigmoid / ipo) on the torch models with
    its fused LM head: the loss and rewards/chosen, rejected, accuracies, margins."""
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    (policy, _), (ref, _) = models
    _, enc = _packed()
    batch = _hf_batch(enc)
    fields = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(policy, outputs=fields)
    add_fused_lm_head(ref, outputs=fields)
    acc = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x,
                                gather=lambda x: x, unwrap_model=lambda m: m)
    stub = types.SimpleNamespace(
        model=policy, accelerator=acc, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=False, ref_model=ref,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        f_divergence_type="reverse_kl", loss_types=[{"dpo": "sigmoid"}.get(kind, kind)],
        loss_weights=[1.0], beta=0.3, label_smoothing=0.0, use_weighting=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        _total_train_tokens=0, _tp_size=1)
    with torch.no_grad():
        theirs = DPOTrainer._compute_loss(stub, policy, batch, False)
    mode = "train" if policy.training else "eval"
    loss, report, _ = _ours(kind, PreferenceConfig(beta=0.3), models)
    _close(loss, theirs)
    for k, v in report.items():
        _close(v, stub._metrics[mode][k][-1])
    assert abs(report["rewards/margins"]) > 1e-2  # a test that can fail: rewards differ


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_simpo_equals_trl_cpo_loss(models, smoothing):
    """TRL's CPOTrainer.cpo_loss with loss_type="simpo" (SimPO: cpo_alpha=0) on
    length-averaged log-probs."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    _, enc = _packed()
    logps, _ = _logps(models[0][0], _hf_batch(enc), average=True)
    n = len(enc)
    stub = types.SimpleNamespace(alpha=0.0, beta=2.0, simpo_gamma=0.7, loss_type="simpo",
                                 label_smoothing=smoothing,
                                 accelerator=types.SimpleNamespace(device="cpu"))
    losses, chosen, rejected = CPOTrainer.cpo_loss(stub, logps[:n], logps[n:])
    cfg = PreferenceConfig(beta=2.0, simpo_gamma=0.7, label_smoothing=smoothing)
    loss, report, _ = _ours("simpo", cfg, models, reference=False)
    _close(loss, losses.mean())
    _close(report["rewards/chosen"], chosen.mean())
    _close(report["rewards/rejected"], rejected.mean())
    _close(report["rewards/accuracies"], (chosen > rejected).float().mean())
    _close(report["rewards/margins"], (chosen - rejected).mean())


def test_orpo_equals_trl_orpo(models):
    """ORPOTrainer: NLL of the chosen sequences (prompt and response, as TRL's) minus
    the mean of odds_ratio_loss; the rewards beta x averaged log-probs."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    _, enc = _packed()
    batch = _hf_batch(enc)
    logps, logits = _logps(models[0][0], batch, average=True)
    n = len(enc)
    stub = types.SimpleNamespace(beta=0.25, accelerator=types.SimpleNamespace(device="cpu"))
    losses, chosen, rejected, _, _ = ORPOTrainer.odds_ratio_loss(stub, logps[:n], logps[n:])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)[:n, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:n, :-1].reshape(-1, logits.shape[-1]),
                                            labels.reshape(-1))
    loss, report, _ = _ours("orpo", PreferenceConfig(beta=0.25), models, reference=False)
    _close(loss, nll - losses.mean())
    _close(report["rewards/chosen"], chosen.mean())
    _close(report["rewards/margins"], (chosen - rejected).mean())
    _close(report["rewards/accuracies"], (chosen > rejected).float().mean())


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_distill_equals_trl_generalized_jsd(models, beta):
    """GKD's generalized_jsd_loss (beta 0 forward KL, 1 reverse KL, 0.5 JSD) at
    temperature 2 on the torch logits of the student and the teacher, against ours
    on the tfjax models' logits, over the scored tokens."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    (student, s_ours), (teacher, t_ours) = models
    _, enc = _packed()
    batch = _hf_batch(enc)
    with torch.no_grad():
        s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)[:, 1:]
    theirs = GKDTrainer.generalized_jsd_loss(s[:, :-1], t[:, :-1], labels=labels, beta=beta,
                                             temperature=2.0)
    ids = jnp.asarray(batch["input_ids"].numpy())
    div = generalized_jsd(s_ours(ids), t_ours(ids), beta, 2.0)[:, :-1]
    mask = jnp.asarray((labels != -100).numpy(), jnp.float32)
    ours = float((div * mask).sum() / mask.sum())
    _close(ours, theirs)
    assert float(theirs) > 1e-3
