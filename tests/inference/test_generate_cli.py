"""`python -m tfjax.generate` on a checkpoint written by the trainer itself."""

import io

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_run import saved_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """(workdir, state) of a run directory as `python -m tfjax.train` leaves it
    (tests/tiny_run.py)."""
    return saved_run(tmp_path_factory.mktemp("gen_run"))


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
