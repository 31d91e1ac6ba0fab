"""`python -m tfjax.generate` on a checkpoint written by the trainer itself."""

import io

import jax
import numpy as np
import pytest
from flax import nnx

from tfjax import config as C


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as `python -m tfjax.train` leaves it: the trainer's own initial
    state saved by its own Checkpointer at step 3, and config.json written as
    `Trainer.train` writes it (no train step is compiled: that is the trainer's test)."""
    import json

    from tfjax.train.trainer import Trainer, _plain

    tmp = tmp_path_factory.mktemp("gen_run")
    corpus = tmp / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    cfg = C.from_dict(C.RunConfig, dict(
        model=dict(vocab_size=259, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                   num_layers=2, norm="rmsnorm", position="rope", init_std=0.5),
        train=dict(steps=3, batch_size=2, seq_len=32, warmup_steps=1, log_every=1,
                   eval_at_end=False, sample_tokens=0, progress=False),
        data=dict(source="text", paths=(str(corpus),), val_paths=(str(corpus),)),
        checkpoint=dict(enabled=True, every_steps=0, async_save=False)))
    wd = str(tmp / "w")
    tr = Trainer(cfg, wd, devices=jax.devices()[:1], log=lambda s: None)
    state = tr.init_state()
    tr.checkpointer.save(3, state, tr.train_iterator().get_state(), wait=True)
    tr.checkpointer.close()
    with open(f"{wd}/config.json", "w") as f:
        json.dump(_plain(cfg), f, indent=1)
    return wd, state


def test_cli_restores_the_trained_model_and_streams(run_dir):
    from tfjax.generate import run
    from tfjax.models import unrolled
    from tfjax.train.checkpoint import load_run, restore_run

    wd, state = run_dir
    model, cfg, _, step = load_run(wd)
    assert step == 3 and cfg.model.num_kv_heads == 2
    _, graphdef, saved, _, _ = restore_run(wd)
    trained = jax.tree.leaves(state["params"])
    restored = jax.tree.leaves(saved["params"])
    assert len(trained) == len(restored)
    for a, b in zip(trained, restored):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the CLI decodes with the layers unrolled: the same values, per layer
    assert model.config.scan_layers is False and model.layers.cycles is None
    twin = unrolled(nnx.merge(graphdef, saved["params"], saved["rest"]))
    for a, b in zip(jax.tree.leaves(nnx.state(twin, nnx.Param)),
                    jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    out = io.StringIO()
    text = run(wd, "def ", max_new_tokens=6, out=out, stop_at_eos=False)
    assert out.getvalue() == "def " + text + "\n"
    assert isinstance(text, str)


def test_cli_usage_errors(tmp_path, capsys):
    from tfjax.generate import main

    assert main(["--workdir", str(tmp_path), "--prompt", "x"]) == 2  # no config.json
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "--workdir" in help_text and "--temperature" in help_text
