"""train.objective="image_lm" through the one trainer: the loss falls on the built-in
shape scenes, a resumed run continues bitwise, a data x fsdp mesh gives one device's
losses, and the config errors come before anything compiles."""

import numpy as np
import pytest
from tiny_setup import devices, losses, preempt_after, run, tiny_config

from tfjax.train import Trainer

VISION = dict(image_size=12, patch_size=6, d_model=16, num_layers=1, num_heads=2, d_ff=32,
              image_token_id=259)


def config(model=None, train=None, data=None, **sections):
    return tiny_config(
        model={**dict(vocab_size=260, prefix_lm=True, vision=VISION), **(model or {})},
        train={**dict(objective="image_lm", batch_size=8, steps=6, seq_len=64, lr=1e-2),
               **(train or {})},
        data={**dict(source="synthetic"), **(data or {})}, **sections)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("image_lm"), config(train=dict(eval_at_end=True),
                                                           mesh=dict(data=1)))


def test_image_lm_trains_and_evaluates(reference):
    _, s = reference
    got = losses(s)
    assert len(got) == 6 and np.isfinite(got).all() and got[-1] < got[0], got
    assert 0.0 <= s["val_accuracy"] <= 1.0 and 0.0 <= s["val_exact_match"] <= 1.0
    assert np.isfinite(s["val_loss"]) and s["val_bytes"] > 0


def test_image_lm_resume_is_exact(tmp_path, reference):
    _, ref = reference
    cfg = config(mesh=dict(data=1), checkpoint=dict(enabled=True, every_steps=2, keep=2))
    wd = str(tmp_path / "killed")
    tr = Trainer(cfg, wd, devices=devices(1), log=lambda s: None)
    preempt_after(tr, 3)
    assert tr.train()["step"] == 3
    s = Trainer(cfg, wd, devices=devices(1), log=lambda s: None).train()
    assert sorted(s["history"]) == [4, 5, 6]
    assert [s["history"][k] for k in (4, 5, 6)] == [ref["history"][k] for k in (4, 5, 6)]


@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=4), dict(data=2)])
def test_image_lm_on_a_mesh_matches_one_device(tmp_path, reference, mesh):
    """data x fsdp (GSPMD), and data alone (the local gradients of tfjax.train.step)."""
    _, ref = reference
    tr, s = run(tmp_path, config(mesh=mesh), n_devices=8 if "fsdp" in mesh else 2)
    if "fsdp" in mesh:
        emb = tr.state["params"]["embed"]["tokens"]["embedding"].get_value()
        assert "fsdp" in str(emb.sharding.spec)
    np.testing.assert_allclose(losses(s), losses(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("sections,message", [
    (dict(model=dict(vision=dict(image_size=0, image_token_id=-1), prefix_lm=False)),
     "train.objective: 'image_lm' trains a decoder with an image tower"),
    (dict(model=dict(vision=dict(VISION, image_token_id=97))),
     "model.vision.image_token_id: 97 must be an id of the model (< model.vocab_size=260) "
     "that the text never uses; set it to 259"),
    (dict(train=dict(seq_len=6)), "train.seq_len: 6 cannot hold a row's 4 image tokens"),
    (dict(data=dict(source="stdlib")), "data.source: 'image_lm' reads examples"),
    (dict(train=dict(objective="causal_lm")), "data.source: 'synthetic' (shipped examples) feeds"),
])
def test_config_errors_name_the_field(tmp_path, sections, message):
    with pytest.raises(ValueError) as e:
        Trainer(config(**sections), str(tmp_path), devices=devices(1), log=lambda s: None)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_forward_sums_are_the_prefix_models_target_loss():
    """image_lm's loss sums against a plain computation: the model called with the
    row's token types, the cross-entropy of the scored targets, exact rows counted."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tfjax.config import DataConfig, VisionConfig
    from tfjax.data.image_text import image_text_batches, image_text_examples
    from tfjax.data.tokenizer import ByteTokenizer
    from tfjax.models import build
    from tfjax.train.objectives import OBJECTIVES

    vision = VisionConfig(**VISION)
    model = build(dict(vocab_size=260, d_model=32, num_layers=2, num_heads=4, d_ff=48,
                       prefix_lm=True, vision=VISION), rngs=nnx.Rngs(0))
    examples = image_text_examples(DataConfig(source="synthetic"), "validation", vision)
    b = next(image_text_batches(examples, ByteTokenizer(), vision, seq_len=64, global_batch=3,
                                shuffle=False, repeat=False))
    b = {k: jnp.asarray(v) for k, v in b.items()}
    got = jax.jit(lambda m, b: OBJECTIVES.get("image_lm").forward(m, b))(model, b)
    logits = model(b["inputs"], pixel_values=b["pixel_values"],
                   token_type_ids=b["token_type_ids"], segment_ids=b["segment_ids"])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["targets"][..., None], -1)[..., 0]
    mask = np.asarray(b["mask"], bool)
    np.testing.assert_allclose(got["nll"], np.asarray(nll)[mask].sum(), rtol=1e-5)
    assert got["tokens"] == mask.sum() and got["rows"] == 3
    hit = np.asarray(jnp.argmax(logits, -1) == b["targets"])
    assert got["correct"] == hit[mask].sum()
    assert got["exact"] == sum(hit[r][mask[r]].all() for r in range(3))
