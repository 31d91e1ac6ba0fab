"""Continuing a checkpoint at a longer context (`context_extension`,
tfjax.train.init_from): the config's RoPE fields and max_len win over the
checkpoint's only when asked, every other model field must still agree, and each
refusal is one line naming the field and the fix."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_run import saved_run

from tfjax import config as C
from tfjax.train.init_from import CONTEXT_FIELDS, merge_model, resolve_init_from

THEIRS = C.model_config(dict(d_model=32, num_heads=4, max_len=128, rope=dict(theta=500000.0)))
EXTENDED = dict(max_len=1024, rope=dict(scaling="llama3", factor=8.0, original_max_len=128))


def one_line(e) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_context_fields_are_rope_scaling_and_max_len():
    assert "max_len" in CONTEXT_FIELDS and "rope.scaling" in CONTEXT_FIELDS
    assert "rope.factor" in CONTEXT_FIELDS and "rope.theta" in CONTEXT_FIELDS
    # which dims rotate, and how they pair, is what the checkpoint was trained with
    assert "rope.fraction" not in CONTEXT_FIELDS and "rope.layout" not in CONTEXT_FIELDS
    assert "d_model" not in CONTEXT_FIELDS


def test_extension_takes_the_configs_rope_and_the_checkpoints_rest():
    mine = C.model_config(dict(EXTENDED, attention=dict(context_parallel="ulysses")))
    got = merge_model(mine, THEIRS, "ckpt", extend=True)
    assert got.rope.scaling == "llama3" and got.rope.factor == 8.0
    assert got.rope.original_max_len == 128 and got.max_len == 1024
    assert got.rope.theta == 500000.0  # left at the default: the checkpoint's
    assert got.d_model == 32 and got.attention.context_parallel == "ulysses"
    # the same config without a change to make: the checkpoint's model as before
    assert merge_model(C.model_config({}), THEIRS, "ckpt", extend=True) == THEIRS


@pytest.mark.bad_input
def test_a_rope_change_without_extension_names_the_flag():
    with pytest.raises(ValueError) as e:
        merge_model(C.model_config(EXTENDED), THEIRS, "ckpt")
    msg = one_line(e)
    assert msg.startswith("model.max_len: the config sets 1024, but the checkpoint "
                          "init_from=ckpt has 128")
    assert "--config.context_extension=True" in msg and "drop --config.model.max_len" in msg
    with pytest.raises(ValueError, match=r"model.rope.scaling: .*context_extension=True"):
        merge_model(C.model_config(dict(rope=EXTENDED["rope"])), THEIRS, "ckpt")


@pytest.mark.bad_input
@pytest.mark.parametrize("mine, theirs, match", [
    (dict(EXTENDED, d_model=48), {}, r"^model.d_model: the config sets 48, but the checkpoint "
                                     r"init_from=ckpt has 32, .*drop --config.model.d_model"),
    (dict(rope=dict(fraction=0.5)), {}, r"^model.rope.fraction: .*drop --config.model.rope"),
    (dict(max_len=1024), dict(position="learned"),
     r"^model.max_len: .*learned position table of 128 rows.*drop --config.model.max_len"),
    (dict(rope=dict(scaling="linear", factor=2.0)), dict(position="alibi"),
     r"^model.rope.scaling: .*position='alibi', not RoPE; drop --config.model.rope.scaling"),
])
def test_extension_refuses_what_is_not_context(mine, theirs, match):
    base = C.model_config(dataclasses.asdict(THEIRS) | theirs) if theirs else THEIRS
    with pytest.raises(ValueError, match=match) as e:
        merge_model(C.model_config(mine), base, "ckpt", extend=True)
    one_line(e)


@pytest.mark.bad_input
def test_extension_without_init_from_is_one_line():
    with pytest.raises(ValueError, match=r"^context_extension: .*init_from is empty") as e:
        C.from_dict(C.RunConfig, dict(context_extension=True)).validate()
    one_line(e)


def test_resolve_init_from_a_workdir_extends_its_rope(tmp_path):
    wd, _ = saved_run(tmp_path)  # seq_len 32, plain RoPE
    ext = dict(rope=dict(scaling="yarn", factor=8.0, original_max_len=32))
    cfg = C.from_dict(C.RunConfig, dict(init_from=wd, context_extension=True, model=ext,
                                        train=dict(seq_len=256)))
    got = resolve_init_from(cfg)
    assert got.model.rope.scaling == "yarn" and got.model.rope.original_max_len == 32
    assert got.model.d_model == 32 and got.model.num_layers == 2  # the checkpoint's
    with pytest.raises(ValueError, match=r"^model.rope.scaling: .*context_extension=True"):
        resolve_init_from(dataclasses.replace(cfg, context_extension=False))
