"""LoRA (`tfjax.train.lora`): adapters sharded by the base's logical axes on a
simulated mesh, an optimizer state of adapter-sized arrays only, step 0 equal to the
base, a frozen base, exact resume, the merged export (adapted matrices moved by a
delta of rank <= r, everything else bit-identical) and the PEFT export (same logits
in `peft.PeftModel` as in tfjax), bad input refused before anything compiles."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_finetune import _jsonl, ft_config, hf_llama, trainer  # noqa: F401 (fixture)
from tiny_setup import devices, preempt_after, tiny_config

from tfjax import config as C
from tfjax.export import main as export_main
from tfjax.interop.safetensors_io import SafetensorsCheckpoint
from tfjax.train import Trainer
from tfjax.train.lora import parse_targets

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")


def _flat(tree):
    return {p: v.get_value() for p, v in nnx.to_flat_state(tree)}


def _host(tree):
    return {p: np.asarray(jax.device_get(v)) for p, v in _flat(tree).items()}


def test_adapters_sharded_frozen_and_step0_is_the_base():
    """8 devices (data 2, fsdp 2, tensor 2): A takes the base's input axes' sharding, B
    its output axes'; the optimizer state holds adapter-sized arrays only; step 0
    computes the base model exactly (B = 0); a step moves B and leaves the base
    bit-identical."""
    cfg = tiny_config(model=dict(activation="swiglu"), train=dict(steps=1, warmup_steps=1),
                      lora=dict(rank=2, alpha=4.0, targets="all"),
                      mesh=dict(data=2, fsdp=2, tensor=2))
    tr = Trainer(cfg, "/nonexistent", devices=devices(8), log=lambda s: None)
    prog = tr.program
    sh = prog.state_shardings
    base_sh = _flat(sh["frozen"])
    for site in prog.lora.sites:
        w = base_sh[site.path].spec
        w = tuple(w) + (None,) * (len(site.batch + site.inp + site.out) - len(w))
        a, b = (_flat(sh["params"])[site.path + (k,)].spec for k in ("lora_a", "lora_b"))
        assert tuple(a) == tuple(w[i] for i in site.batch + site.inp) + (None,), site
        assert tuple(b) == tuple(w[i] for i in site.batch) + (None,) + tuple(
            w[i] for i in site.out), site
    assert {s.path[-2] for s in prog.lora.sites} == {"q", "k", "v", "o", "wi_gate", "wi_up", "wo"}
    assert any(tuple(_flat(sh["params"])[s.path + ("lora_a",)].spec)[1:2] == ("fsdp",)
               for s in prog.lora.sites)  # some adapter really is sharded

    # the optimizer state: adapter-shaped moments (AdamW's mu, nu) and scalar counters
    ashapes = {x.shape for x in jax.tree.leaves(prog.abstract_state["params"])}
    opt = jax.tree.leaves(prog.abstract_state["opt"])
    assert all(x.shape in ashapes or x.shape == () for x in opt)
    n_adapter = sum(math.prod(x.shape) for x in jax.tree.leaves(prog.abstract_state["params"]))
    assert sum(math.prod(x.shape) for x in opt) <= 2 * n_adapter + 4
    assert n_adapter < 0.1 * prog.num_params

    s0 = tr.init_state()
    frozen0, ad0 = _host(s0["frozen"]), _host(s0["params"])
    assert all(not v.any() for p, v in ad0.items() if p[-1] == "lora_b")
    assert all(v.any() for p, v in ad0.items() if p[-1] == "lora_a")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 259, size=(2, 16)))
    base = nnx.merge(prog.eval_graphdef, jax.device_get(s0["frozen"]), jax.device_get(s0["rest"]))
    merged = prog.lora.merge(jax.device_get(s0["frozen"]), jax.device_get(s0["params"]))
    lora = nnx.merge(prog.eval_graphdef, merged, jax.device_get(s0["rest"]))
    np.testing.assert_array_equal(np.asarray(lora(ids)), np.asarray(base(ids)))

    tr.train()
    after, ad = _host(tr.state["frozen"]), _host(tr.state["params"])
    for p, v in frozen0.items():
        np.testing.assert_array_equal(after[p], v, err_msg=str(p))
    assert all(ad[p].any() for p in ad if p[-1] == "lora_b")  # the adapters trained


def test_resume_is_exact(tmp_path):
    """Killed after step 2 and rerun: the same losses and adapters as the straight run,
    restored from the workdir (never re-initialised); eval and sampling run on LoRA."""
    cfg = tiny_config(train=dict(steps=4), lora=dict(rank=4, targets="q,v"),
                      checkpoint=dict(enabled=True))
    one = devices(1)
    # the straight run also evaluates and samples through the merged model
    full = tiny_config(train=dict(steps=4, eval_at_end=True, sample_tokens=3),
                       lora=dict(rank=4, targets="q,v"), checkpoint=dict(enabled=True))
    straight = Trainer(full, str(tmp_path / "a"), devices=one, log=lambda s: None)
    want = straight.train()
    assert np.isfinite(want["val_loss"]) and isinstance(want["sample"], str)
    tr = Trainer(cfg, str(tmp_path / "b"), devices=one, log=lambda s: None)
    preempt_after(tr, 2)
    assert tr.train()["step"] == 2
    tr2 = Trainer(cfg, str(tmp_path / "b"), devices=one, log=lambda s: None)
    tr2.init_state = None  # a resume must not start over
    got = tr2.train()
    assert sorted(got["history"]) == [3, 4]
    assert all(got["history"][k] == want["history"][k] for k in (3, 4))
    a, b = _host(straight.state["params"]), _host(tr2.state["params"])
    for p in a:
        np.testing.assert_array_equal(a[p], b[p])


def test_lora_finetune_exports_merged_and_as_peft(tmp_path, hf_llama):  # noqa: F811
    """LoRA on q, v, down of an HF Llama: the merged export moves exactly those
    matrices, each by a delta of rank <= r, and leaves every other tensor bit-identical;
    the PEFT export on the base model gives tfjax's LoRA logits."""
    peft = pytest.importorskip("peft")
    r = 2
    cfg = ft_config(hf_llama, _jsonl(tmp_path / "d.jsonl"))
    cfg = C.from_dict(C.RunConfig, dict(C.to_config_dict(cfg).to_dict(),
                                        lora=dict(rank=r, alpha=8.0, targets="q,v,down")))
    wd = tmp_path / "w"
    trainer(cfg, wd).train()

    merged = tmp_path / "merged"
    assert export_main(["--workdir", str(wd), "--out", str(merged)]) == 0
    base = SafetensorsCheckpoint(hf_llama)
    out = SafetensorsCheckpoint(str(merged))
    assert set(out.keys()) == set(base.keys())
    targeted = ("q_proj.weight", "v_proj.weight", "down_proj.weight")
    for k in sorted(base.keys()):
        w0, w1 = np.asarray(base.get(k)), np.asarray(out.get(k))
        if not k.endswith(targeted):
            assert w1.dtype == w0.dtype
            np.testing.assert_array_equal(w1, w0, err_msg=k)
            continue
        s = np.linalg.svd(w1.astype(np.float64) - w0, compute_uv=False)
        assert s[0] > 1e-4, k  # trained
        assert s[r] < 1e-4 * s[0] + 1e-6, (k, s[:r + 2])  # rank <= r, up to float32 rounding

    adapters = tmp_path / "adapters"
    assert export_main(["--workdir", str(wd), "--out", str(adapters), "--adapters_only"]) == 0
    conf = json.loads((adapters / "adapter_config.json").read_text())
    assert conf["r"] == r and conf["lora_alpha"] == 8.0
    assert sorted(conf["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    ids = np.random.default_rng(1).integers(0, 259, size=(2, 13))
    hf_base = transformers.LlamaForCausalLM.from_pretrained(hf_llama).eval()
    model = peft.PeftModel.from_pretrained(hf_base, str(adapters)).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    from tfjax.train.checkpoint import load_run
    ours = np.asarray(load_run(str(wd))[0](jnp.asarray(ids)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    with torch.no_grad():  # and the adapters matter
        plain = transformers.LlamaForCausalLM.from_pretrained(hf_llama)(torch.tensor(ids))
    assert np.abs(plain.logits.numpy() - theirs).max() > 1e-3


@pytest.mark.bad_input
def test_bad_input_is_one_line_before_compiling(tmp_path, monkeypatch):
    import tfjax.train.program as P

    def no_steps(*a, **k):
        raise AssertionError("make_train_step reached")

    monkeypatch.setattr(P, "make_train_step", no_steps)
    cases = [
        (dict(lora=dict(rank=4, targets="q,qq")), r"lora.targets: unknown name 'qq'; use q, k"),
        (dict(lora=dict(rank=4, targets="gate")),  # a gelu FFN has no gate
         r"lora.targets: 'gate' match no parameter of this model .*drop it"),
        (dict(lora=dict(rank=-1)), r"lora.rank: got -1; LoRA needs a rank > 0"),
        (dict(lora=dict(alpha=16.0)), r"lora.rank: got 0 with lora.alpha=16.0; LoRA needs a rank"),
        (dict(lora=dict(rank=4, targets=" , ")), r"lora.targets: names no matrix"),
        (dict(lora=dict(rank=4, alpha=-1.0)), r"lora.alpha: must be >= 0"),
    ]
    for sections, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as e:
            Trainer(tiny_config(**sections), str(tmp_path), devices=devices(1),
                    log=lambda s: None)
        assert "\n" not in str(e.value)
    assert parse_targets("attn,down,q") == ("q", "k", "v", "o", "down")


@pytest.mark.bad_input
def test_adapters_only_needs_a_lora_run(tmp_path, capsys):
    cfg = tiny_config(train=dict(steps=1), checkpoint=dict(enabled=True))
    Trainer(cfg, str(tmp_path / "w"), devices=devices(1), log=lambda s: None).train()
    assert export_main(["--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
                        "--adapters_only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --adapters_only: the run in") and "lora.rank=0" in err
