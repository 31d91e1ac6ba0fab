"""Fine-tuning (`init_from`, `tfjax.train.init_from`): from a tiny random Hugging Face
Llama saved in tmp_path and from a tfjax workdir, instruction data scored on the
completions only, exact resume that never re-reads init_from, export back to
transformers with the same logits, and bad input refused before anything compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_hf import save_tiny_llama
from tiny_setup import preempt_after, tiny_config

from tfjax import config as C
from tfjax.data.pipeline import PackedBatches
from tfjax.data.sources import documents
from tfjax.data.tokenizer import ByteTokenizer, load_tokenizer
from tfjax.export import main as export_main
from tfjax.interop import hf
from tfjax.train import Trainer

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

EXAMPLES = [("Q: 2+2?\nA:", " 4"), ("Translate 'chat':", " cat"), ("", "free text, no prompt"),
            ("Name a colour:", " blue, or perhaps a long green"), ("x" * 40, " y" * 12)] * 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """tests/tiny_hf.py's Llama (context 64) with the byte tokenizer's tokenizer.json."""
    path = tmp_path_factory.mktemp("hf_llama")
    save_tiny_llama(path, max_position_embeddings=64)
    return str(path)


def _jsonl(path, examples=EXAMPLES):
    with open(path, "w") as f:
        for p, c in examples:
            f.write(json.dumps(dict(prompt=p, completion=c)) + "\n")
    return str(path)


def ft_config(init_from, data_path, **train):
    return C.from_dict(C.RunConfig, dict(
        init_from=init_from,
        data=dict(source="jsonl", format="instruction", tokenizer="init_from",
                  paths=(data_path,), val_paths=(data_path,)),
        train=dict(dict(steps=3, batch_size=2, seq_len=32, warmup_steps=1, lr=1e-2,
                        log_every=1, eval_at_end=False, sample_tokens=0, progress=False), **train),
        checkpoint=dict(enabled=True, every_steps=0, async_save=False), mesh=dict(data=1)))


def trainer(cfg, workdir):
    return Trainer(cfg, str(workdir), devices=jax.devices()[:1], log=lambda s: None)


def test_instruction_rows_score_the_completions_only(tmp_path):
    """Examples packed end to end like documents (a segment each, positions from 0);
    the mask on the targets that are completion tokens or their EOS, never on the
    prompt; a line without a completion is a one-line error."""
    tok = ByteTokenizer()
    path = _jsonl(tmp_path / "a.jsonl")
    data = C.DataConfig(source="jsonl", format="instruction", paths=(path,), val_paths=(path,))
    T = 48
    it = PackedBatches(documents(data, "validation"), tok, seq_len=T, global_batch=1,
                       shuffle=False, repeat=False)
    ids, scored, seg = [], [], []
    for k, (p, c) in enumerate(EXAMPLES):  # one stream reads the examples in order
        p, c = tok.encode(p), tok.encode(c)
        ids += [tok.bos_id, *p, *c, tok.eos_id]
        scored += [0] * (1 + len(p)) + [1] * (len(c) + 1)
        seg += [k] * (len(p) + len(c) + 2)
    ids, scored, seg = map(np.array, (ids, scored, seg))
    packed = 0
    for r, b in enumerate(it):
        start = r * T  # rows overlap by one token: every token is a target once
        n = min(T, len(ids) - 1 - start)
        np.testing.assert_array_equal(b["inputs"][0, :n], ids[start:start + n])
        np.testing.assert_array_equal(b["mask"][0, :n], scored[start + 1:start + n + 1])
        assert not b["mask"][0, n:].any()
        # a segment per example piece, and positions restart with each example
        pieces = seg[start:start + n]
        np.testing.assert_array_equal(np.diff(b["segment_ids"][0, :n]) != 0,
                                      np.diff(pieces) != 0)
        assert (b["positions"][0, :n][ids[start:start + n] == tok.bos_id] == 0).all()
        packed += b["segment_ids"][0].max() >= 2
    assert r == it.num_batches() - 1 and packed >= 3  # rows that hold several examples
    # documents mode is unchanged: every target inside a document counts
    doc = C.DataConfig(source="jsonl", paths=(_jsonl(tmp_path / "t.jsonl", [("", "abc def")] * 3
                                                     ),), jsonl_field="completion")
    d = next(PackedBatches(documents(doc, "train"), tok, seq_len=8, global_batch=1,
                           shuffle=False))
    assert d["mask"].sum() == (d["segment_ids"][:, :-1] == d["segment_ids"][:, 1:]).sum() + 1

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "only a prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: the record has no field 'completion'.*"
                                         r"add 'completion'") as e:
        documents(C.DataConfig(source="jsonl", format="instruction", paths=(str(bad),)), "train")
    assert "\n" not in str(e.value)


def test_finetune_hf_llama_then_export_has_transformers_logits(tmp_path, hf_llama):
    """Step 0 is the HF model (same logits as transformers); 3 steps move it; the export
    loads in transformers with the logits tfjax gives on it."""
    cfg = ft_config(hf_llama, _jsonl(tmp_path / "d.jsonl"))
    tr = trainer(cfg, tmp_path / "w")
    assert tr.cfg.model.vocab_size == 272 and tr.cfg.model.num_layers == 2  # from config.json
    assert tr.cfg.data.tokenizer == hf_llama  # the directory: load_tokenizer reads its files
    ids = np.random.default_rng(0).integers(0, 259, size=(2, 11))
    base = transformers.LlamaForCausalLM.from_pretrained(hf_llama).eval()
    with torch.no_grad():
        want0 = base(torch.tensor(ids)).logits.numpy()
    s0 = tr.init_state()
    got0 = nnx.merge(tr.program.eval_graphdef, s0["params"], s0["rest"])(jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got0), want0, atol=1e-4)
    summary = tr.train()
    assert summary["step"] == 3 and np.isfinite(list(summary["history"].values())).all()

    out = tmp_path / "hf_out"
    assert export_main(["--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").exists()
    ft = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        theirs = ft(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(hf.load(str(out))[0](jnp.asarray(ids)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert np.abs(theirs - want0).max() > 1e-3  # fine-tuning changed the model
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("ab").input_ids == [257, 97, 98]  # BOS first, as training saw it


def test_finetune_resume_is_exact_and_does_not_reinit(tmp_path, hf_llama):
    """A fine-tune killed after step 2 and rerun equals the straight run bitwise; the
    rerun restores its own checkpoint (init_from's weights are not read again)."""
    data = _jsonl(tmp_path / "d.jsonl")
    cfg = ft_config(hf_llama, data, steps=4)
    straight = trainer(cfg, tmp_path / "straight").train()

    wd = tmp_path / "killed"
    tr = trainer(cfg, wd)
    preempt_after(tr, 2)
    assert tr.train()["step"] == 2
    tr2 = trainer(cfg, wd)
    tr2.init_state = None  # a resume must never start over (from init_from or at random)
    s2 = tr2.train()
    assert sorted(s2["history"]) == [3, 4]
    for k in (3, 4):
        assert s2["history"][k] == straight["history"][k]


def test_finetune_from_a_tfjax_workdir(tmp_path):
    """A tfjax run's latest parameters, a fresh optimizer; the model section must agree."""
    src = tmp_path / "pre"
    pre = tiny_config(train=dict(steps=2), checkpoint=dict(enabled=True),
                      model=dict(activation="swiglu", tie_embeddings=False))
    t0 = Trainer(pre, str(src), devices=jax.devices()[:1], log=lambda s: None)
    t0.train()
    data = _jsonl(tmp_path / "d.jsonl")
    cfg = ft_config(str(src), data, seq_len=32)
    tr = trainer(cfg, tmp_path / "ft")
    assert tr.cfg.model == pre.model and tr.cfg.data.tokenizer == "byte"
    s = tr.init_state()
    for a, b in zip(jax.tree.leaves(s["params"]), jax.tree.leaves(t0.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(s["step"]) == 0
    assert all(not np.asarray(m).any() for m in jax.tree.leaves(s["opt"][1][0].mu))  # fresh
    # a model field set against the checkpoint's: one line naming it
    bad = C.from_dict(C.RunConfig, dict(C.to_config_dict(cfg).to_dict(),
                                        model=dict(d_model=48)))
    with pytest.raises(ValueError, match=r"model.d_model: the config sets 48, but the checkpoint"
                                         r".* has 32.*drop --config.model.d_model"):
        trainer(bad, tmp_path / "x")
    # run-time fields are the config's
    rt = C.from_dict(C.RunConfig, dict(C.to_config_dict(cfg).to_dict(), model=dict(remat="full")))
    assert trainer(rt, tmp_path / "y").cfg.model.remat == "full"


@pytest.mark.slow
def test_finetune_from_checkpoints_on_a_bucket(tmp_path, hf_llama, gcs_bucket):
    """init_from on gs:// (the GCS emulator): a Hugging Face directory (its tokenizer
    with it) and a tfjax workdir on a bucket give the step-0 parameters their local
    originals give."""
    from tfjax import storage

    url = f"{gcs_bucket}/llama"
    for f in os.listdir(hf_llama):
        storage.upload(os.path.join(hf_llama, f), f"{url}/{f}")
    data = _jsonl(tmp_path / "d.jsonl")
    here = trainer(ft_config(hf_llama, data), tmp_path / "a").init_state()
    tr = trainer(ft_config(url, data), tmp_path / "b")
    assert tr.cfg.data.tokenizer == url and tr.cfg.model.vocab_size == 272
    there = tr.init_state()
    for a, b in zip(jax.tree.leaves(here["params"]), jax.tree.leaves(there["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a tfjax run whose workdir is on the bucket, then a fine-tune from it
    pre = tiny_config(train=dict(steps=2), checkpoint=dict(enabled=True, async_save=False))
    t0 = Trainer(pre, f"{gcs_bucket}/pre", devices=jax.devices()[:1], log=lambda s: None)
    t0.train()
    s = trainer(ft_config(f"{gcs_bucket}/pre", data, seq_len=32), tmp_path / "c").init_state()
    for a, b in zip(jax.tree.leaves(s["params"]), jax.tree.leaves(t0.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"^init_from: gs://no-such-bucket-tfjax/m: bucket "
                                         r"gs://no-such-bucket-tfjax does not exist"):
        trainer(ft_config("gs://no-such-bucket-tfjax/m", data), tmp_path / "d")


@pytest.mark.bad_input
def test_bad_input_is_one_line_before_compiling(tmp_path, hf_llama, monkeypatch):
    import tfjax.train.trainer as T

    def no_compile(*a, **k):
        raise AssertionError("build_program reached")

    monkeypatch.setattr(T, "build_program", no_compile)
    data = _jsonl(tmp_path / "d.jsonl")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hi")
    cases = [
        (ft_config(str(tmp_path / "empty"), data), r"init_from: .*empty is not a checkpoint"),
        (ft_config(str(tmp_path / "nowhere"), data), r"init_from: .*nowhere' is not a directory"),
    ]
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a workdir that saved nothing
    (tmp_path / "run" / "config.json").write_text("{}")
    cases.append((ft_config(str(tmp_path / "run"), data), r"init_from: .*run is a tfjax workdir "
                  r"without a finished checkpoint"))
    small = tmp_path / "small"  # the HF checkpoint with a vocabulary the tokenizer overflows
    small.mkdir()
    for f in os.listdir(hf_llama):
        if f != "config.json":
            os.symlink(os.path.join(hf_llama, f), small / f)
    with open(os.path.join(hf_llama, "config.json")) as f:
        c = json.load(f)
    (small / "config.json").write_text(json.dumps(dict(c, vocab_size=200)))
    cases.append((ft_config(str(small), data),
                  r"data.tokenizer: .*small' has 259 ids, more than the checkpoint's "
                  r"vocabulary \(vocab_size 200.*--config.data.tokenizer=init_from"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "completion": "c"}\n{"completion": "no prompt"}\n')
    cases.append((ft_config(hf_llama, str(bad)), r"bad.jsonl:2: the record has no field 'prompt'"))
    for cfg, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as e:
            trainer(cfg, tmp_path / "w")
        assert "\n" not in str(e.value)
    assert load_tokenizer(os.path.join(hf_llama, "tokenizer.json")).vocab_size == 259


def _cli(module, *args, timeout=300):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=root, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.bad_input
def test_cli_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl")
    p = _cli("tfjax.train", "--config", "configs/finetune.py", "--workdir", str(tmp_path / "w"),
             f"--config.init_from={tmp_path}", f"--config.data.paths=('{data}',)")
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("config error: init_from: ") and "not a checkpoint" in lines[-1]
    p = _cli("tfjax.export", "--workdir", str(tmp_path), "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and p.stderr.strip().startswith("error: --workdir: ")


def test_cli_finetune_then_export_loads_in_transformers(tmp_path, hf_llama):
    """The documented commands, end to end (slow: two processes)."""
    data = _jsonl(tmp_path / "d.jsonl")
    wd, out = str(tmp_path / "w"), str(tmp_path / "hf")
    p = _cli("tfjax.train", "--config", "configs/finetune.py", "--workdir", wd,
             f"--config.init_from={hf_llama}", f"--config.data.paths=('{data}',)",
             f"--config.data.val_paths=('{data}',)", "--config.train.steps=2",
             "--config.train.batch_size=2", "--config.train.seq_len=32",
             "--config.train.eval_batches=1", "--config.train.progress=False")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "init_from:" in p.stdout and "val_loss" in p.stdout
    p = _cli("tfjax.export", "--workdir", wd, "--out", out)
    assert p.returncode == 0, p.stderr
    ids = torch.tensor([[257, 81, 58, 32, 50]])
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(ids).logits.numpy()
    ours = np.asarray(hf.load(out)[0](jnp.asarray(ids.numpy())))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
