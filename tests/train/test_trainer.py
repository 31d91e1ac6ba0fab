"""The trainer end to end on 8 simulated CPU devices: meshes agree with one device,
shardings follow the rules, resume is exact, checkpoints move between meshes, bad
settings fail before compiling."""

import json
import os
import re

import numpy as np
import pytest
import tiny_decoder
from jax.sharding import PartitionSpec as P
from tiny_setup import devices, preempt_after, tiny_config

from tfjax.train import Trainer


def run(tmp_path, name, n_devices=8, builder=tiny_decoder.build, **sections):
    cfg = tiny_config(**sections)
    tr = Trainer(cfg, str(tmp_path / name), build_model=builder, devices=devices(n_devices),
                 log=lambda s: None)
    return tr, tr.train()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of 4 steps on one device."""
    _, s = run(tmp_path_factory.mktemp("ref"), "one", n_devices=1, mesh=dict(data=1))
    return s


@pytest.mark.parametrize("mesh", [
    dict(data=8),
    dict(data=1, fsdp=8),
    dict(data=2, fsdp=2, tensor=2),
    dict(data=4, sequence=2),
], ids=["data8", "fsdp8", "d2f2t2", "d4s2"])
def test_meshes_match_one_device(tmp_path, reference, mesh):
    _, s = run(tmp_path, "m", mesh=mesh)
    ref = reference["history"]
    got = s["history"]
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[k] for k in sorted(got)], [ref[k] for k in sorted(ref)],
                               rtol=2e-5, atol=2e-5)
    assert ref[4] < ref[1]  # it learns


def test_param_shardings_follow_rules(tmp_path):
    cfg = tiny_config(mesh=dict(data=2, fsdp=2, tensor=2))
    tr = Trainer(cfg, str(tmp_path), build_model=tiny_decoder.build, devices=devices(8),
                 log=lambda s: None)
    state = tr.init_state()
    blk = state["params"]["blocks"][0]
    assert blk["q"].get_value().sharding.spec == P("fsdp", "tensor", None)   # embed, heads, head_dim
    assert blk["o"].get_value().sharding.spec == P("tensor", None, "fsdp")   # heads, head_dim, embed
    assert blk["up"].get_value().sharding.spec == P("fsdp", "tensor")        # embed, mlp
    assert blk["down"].get_value().sharding.spec == P("tensor", "fsdp")      # mlp, embed
    assert blk["n1"].get_value().sharding.spec == P(None)                    # norm: replicated
    assert state["params"]["embed"].get_value().sharding.spec == P(None, "fsdp")  # vocab 259 % 2 -> replicated
    assert any("vocab=259" in n for n in tr.program.notes)
    # optimizer moments are sharded like their parameters, never whole on one device
    mu = state["opt"][1][0].mu["blocks"][0]["up"].get_value()
    assert mu.sharding.spec == P("fsdp", "tensor")
    assert mu.addressable_shards[0].data.shape == (16, 32)


def test_resume_is_exact_and_ignores_half_written(tmp_path):
    sections = dict(train=dict(steps=6, eval_at_end=True),
                    checkpoint=dict(enabled=True, every_steps=2, keep=2))
    _, full = run(tmp_path, "full", **sections)

    cfg = tiny_config(**sections)
    wd = str(tmp_path / "killed")
    tr = Trainer(cfg, wd, build_model=tiny_decoder.build, devices=devices(8), log=lambda s: None)
    preempt_after(tr, 3)
    s1 = tr.train()
    assert s1["preempted"] and s1["step"] == 3
    ckpt = os.path.join(wd, "checkpoints")
    assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == [2, 3]  # keep=2
    # a half-written checkpoint (orbax's temporary directory) must not be picked up
    os.makedirs(os.path.join(ckpt, "5.orbax-checkpoint-tmp-1234", "state"))

    tr2 = Trainer(cfg, wd, build_model=tiny_decoder.build, devices=devices(8), log=lambda s: None)
    s2 = tr2.train()
    assert sorted(s2["history"]) == [4, 5, 6]
    for k in (4, 5, 6):
        assert s2["history"][k] == full["history"][k]  # bitwise: same program, same data
    records = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    assert {"loss", "bpb", "lr", "grad_norm"} <= set(records[0])
    assert {"tokens_per_s", "step_time_s", "mfu"} <= set(records[1])  # after the compile step
    assert any("val_bpb" in r and "val_loss" in r for r in records)
    assert os.listdir(os.path.join(wd, "tb"))


def test_restore_onto_another_mesh(tmp_path):
    sections = dict(train=dict(steps=4), checkpoint=dict(enabled=True, every_steps=2))
    _, full = run(tmp_path, "full", mesh=dict(data=8), **sections)
    wd = str(tmp_path / "moved")
    cfg = tiny_config(mesh=dict(data=8), **sections)
    tr = Trainer(cfg, wd, build_model=tiny_decoder.build, devices=devices(8), log=lambda s: None)
    preempt_after(tr, 2)
    assert tr.train()["step"] == 2
    cfg2 = tiny_config(mesh=dict(data=2, fsdp=2, tensor=2), **sections)
    tr2 = Trainer(cfg2, wd, build_model=tiny_decoder.build, devices=devices(8), log=lambda s: None)
    s2 = tr2.train()
    q = tr2.state["params"]["blocks"][0]["q"].get_value()
    assert q.sharding.spec == P("fsdp", "tensor", None)
    np.testing.assert_allclose([s2["history"][k] for k in (3, 4)],
                               [full["history"][k] for k in (3, 4)], rtol=2e-5)


def test_gradient_accumulation_matches_one_batch(tmp_path, reference):
    _, s = run(tmp_path, "acc", n_devices=1, mesh=dict(data=1), train=dict(microbatches=4))
    np.testing.assert_allclose([s["history"][k] for k in (1, 2, 3, 4)],
                               [reference["history"][k] for k in (1, 2, 3, 4)], rtol=2e-5)


def test_data_parallel_cpu_steps_sum_gradients_once(tmp_path, reference, monkeypatch,
                                                    bench_attention):
    """On a data-parallel CPU mesh each device computes its rows' gradients (every
    microbatch) and one psum sums them: no all-reduce inside the microbatch loop (and
    the layer loops it runs), and the losses of one device. Positive control: GSPMD
    alone (the step without local axes) all-reduces inside it."""
    import jax

    from tfjax.train import program

    sections = dict(mesh=dict(data=4), train=dict(microbatches=2))
    tr, s = run(tmp_path, "local", n_devices=4, **sections)
    assert any("gradients summed once a step over mesh axes data" in n for n in tr.program.notes)
    np.testing.assert_allclose([s["history"][k] for k in (1, 2, 3, 4)],
                               [reference["history"][k] for k in (1, 2, 3, 4)], rtol=2e-5)
    batch = tr.global_batch(next(tr.train_iterator()))

    def collectives_in_loop(trainer):  # all-reduces the microbatch loop runs
        state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                             trainer.program.abstract_state, trainer.program.state_shardings)
        text = trainer.program.step.lower(state, batch).compile().as_text()
        return bench_attention.last_loop_body(text).count(" all-reduce(")

    assert collectives_in_loop(tr) == 0
    monkeypatch.setattr(program, "local_gradient_axes", lambda *a: ())
    gspmd = Trainer(tiny_config(**sections), str(tmp_path / "gspmd"),
                    build_model=tiny_decoder.build, devices=devices(4), log=lambda s: None)
    assert not any("summed once" in n for n in gspmd.program.notes)
    assert collectives_in_loop(gspmd) >= 1
    # not with parameters sharded over a batch axis (fsdp), nor on one device
    fsdp = Trainer(tiny_config(mesh=dict(data=1, fsdp=4)), str(tmp_path / "fsdp"),
                   build_model=tiny_decoder.build, devices=devices(4), log=lambda s: None)
    assert not any("summed once" in n for n in fsdp.program.notes)
    # nor when the forward draws dropout masks (per-device masks are not the rows of
    # the global one): tfjax.train.step.changes_state reads it from the jaxpr
    monkeypatch.undo()
    drop = Trainer(tiny_config(mesh=dict(data=4), model=dict(dropout_rate=0.1)),
                   str(tmp_path / "drop"), devices=devices(4), log=lambda s: None)
    assert not any("summed once" in n for n in drop.program.notes)
    plain = Trainer(tiny_config(mesh=dict(data=4)), str(tmp_path / "plain"), devices=devices(4),
                    log=lambda s: None)
    assert any("summed once" in n for n in plain.program.notes)


BAD = [
    (dict(mesh=dict(data=3)), "mesh: data=3"),
    (dict(mesh=dict(data=4, fsdp=4)), "product is 8"),
    (dict(mesh=dict(data=8), train=dict(batch_size=12)), "train.batch_size: 12 is not divisible by the 8 batch shards"),
    (dict(mesh=dict(data=4, sequence=2), train=dict(seq_len=33)), "train.seq_len: 33 is not divisible by the sequence axis"),
    (dict(mesh=dict(data=8), train=dict(batch_size=8, microbatches=2)), "train.batch_size: 8 is not divisible by the 8 batch shards (mesh data*fsdp*expert = 8) x train.microbatches=2"),
    (dict(model=dict(vocab_size=256)), "model.vocab_size: 256 is smaller than the tokenizer"),
]


@pytest.mark.parametrize("sections,message", BAD)
def test_bad_settings_fail_before_compiling(tmp_path, sections, message):
    cfg = tiny_config(**sections)
    with pytest.raises(ValueError, match=re.escape(message)):
        Trainer(cfg, str(tmp_path), build_model=tiny_decoder.build, devices=devices(8),
                log=lambda s: None)


def test_unknown_logical_axis(tmp_path):
    from tfjax.config import DEFAULT_RULES
    rules = tuple(r for r in DEFAULT_RULES if r[0] != "mlp")
    cfg = tiny_config(mesh=dict(data=8, rules=rules))
    with pytest.raises(ValueError, match=r"mesh.rules: .*'mlp'.*add \('mlp',\)"):
        Trainer(cfg, str(tmp_path), build_model=tiny_decoder.build, devices=devices(8),
                log=lambda s: None)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a.txt").write_text("hello world")
    cfg = tiny_config(data=dict(source="text", paths=(str(tmp_path / "a.txt"),),
                                val_paths=(str(tmp_path / "empty" / "*.txt"),)))
    with pytest.raises(ValueError, match="data.val_paths: .* matches no file"):
        Trainer(cfg, str(tmp_path / "w"), build_model=tiny_decoder.build, devices=devices(8),
                log=lambda s: None)


def test_bf16_compute_tracks_fp32(tmp_path):
    """model.dtype=bfloat16 (compute) with fp32 parameters and optimizer state, on a
    data=2 x fsdp=2 x tensor=2 mesh: the losses follow the fp32 run on one device
    within bf16 precision, and nothing is stored in bf16."""
    from tfjax.models import build

    _, f32 = run(tmp_path, "f32", n_devices=1, builder=build, mesh=dict(data=1))
    tr, bf16 = run(tmp_path, "bf16", builder=build, mesh=dict(data=2, fsdp=2, tensor=2),
                   model=dict(dtype="bfloat16"))
    a = np.array([f32["history"][k] for k in sorted(f32["history"])])
    b = np.array([bf16["history"][k] for k in sorted(bf16["history"])])
    assert np.isfinite(b).all() and b[-1] < b[0]
    np.testing.assert_allclose(b, a, rtol=3e-2)
    assert np.abs(b - a).max() > 0  # the compute dtype really changed
    state = tr.init_state()
    import jax
    dtypes = {str(x.dtype) for x in jax.tree.leaves((state["params"], state["opt"]))
              if hasattr(x, "dtype") and x.dtype.kind == "f"}
    assert dtypes == {"float32"}, dtypes


def test_rerun_compiles_nothing_new(tmp_path):
    """train.compilation_cache="workdir": the first run stores its executables under
    WORKDIR/compilation_cache, a rerun of the same command finds every one of them
    (no new entry) and trains the same; JAX's own setting is restored after."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    here = dict(compilation_cache="workdir")  # not the trainer tests' shared cache
    _, first = run(tmp_path, "w", n_devices=2, mesh=dict(data=2), train=here)
    cache = tmp_path / "w" / "compilation_cache"
    stored = sorted(os.listdir(cache))
    assert any(name.startswith("jit_train_step") for name in stored), stored
    _, again = run(tmp_path, "w", n_devices=2, mesh=dict(data=2), train=here)
    assert sorted(os.listdir(cache)) == stored
    assert again["history"] == first["history"]
    assert jax.config.jax_compilation_cache_dir == before
    _, off = run(tmp_path, "off", n_devices=2, mesh=dict(data=2),
                 train=dict(compilation_cache=""))
    assert not (tmp_path / "off" / "compilation_cache").exists()
    _, auto = run(tmp_path, "auto", n_devices=2, mesh=dict(data=2))  # JAX's (conftest's) dir
    assert not (tmp_path / "auto" / "compilation_cache").exists()
