"""Every preset: full size matches the published parameter count (built
abstractly), and the tiny variant runs forward and backward with finite values."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import run_config

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def load(name):
    spec = importlib.util.spec_from_file_location(f"preset_{name}", CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Published sizes of the reference checkpoints (Hugging Face parameter counts).
PARAMS = {
    "gpt2": 124_439_808,  # gpt2
    "llama": 8_030_261_248,  # Llama-3.1-8B
    "mistral": 7_241_732_096,  # Mistral-7B-v0.1
    "gemma2": 2_614_341_888,  # gemma-2-2b
    "neox": 1_414_647_808,  # pythia-1.4b
    "bloom": 559_214_592,  # bloom-560m
    "bert": 109_482_240 + 590_592 + 1_536 + 30_522 + 1_538,  # bert-base + MLM head + 2 classes
    "t5": 222_903_552,  # t5-base
    "mixtral": 46_702_792_704,  # Mixtral-8x7B-v0.1
    "mamba": 129_135_360,  # state-spaces/mamba-130m
    # state-spaces/mamba2-130m / -370m: counted from their config (transformers'
    # Mamba2ForCausalLM of the converted config has the same count)
    "mamba2": 128_989_632,
    "mamba2:370m": 368_346_624,
    # Qwen3-Next-80B-A3B: transformers' Qwen3NextForCausalLM of its config (model card: 80B)
    "qwen3_next": 79_674_391_296,
    # transformers' GptOssForCausalLM / DeepseekV3ForCausalLM of the checkpoints' configs
    "gpt_oss": 20_914_757_184,  # gpt-oss-20b (model card: 21B)
    "deepseek_v3": 671_026_404_352,  # DeepSeek-V3 without its MTP module (report: 671B)
    "llama4": 107_769_861_120,  # Llama-4-Scout's text model (Llama4ForCausalLM of its config)
    "jamba": 51_570_323_328,  # Jamba-v0.1: counted from its config.json (model card: 52B)
    # transformers' Zamba2ForCausalLM(Zamba2Config()) on the meta device (its docstring:
    # Zamba2-2.7B-style; the hub config.json was not read, so no checkpoint is claimed)
    "zamba2": 2_481_848_336,
    # Counted from the checkpoints' config.json (model cards: 1B, 3.88B text, 27B text; 3B; 7B)
    "gemma3": 999_885_952,  # gemma-3-1b-pt
    "gemma3:4b": 3_880_263_168,  # gemma-3-4b-pt, its text decoder
    "gemma3:27b": 27_009_346_304,  # gemma-3-27b-pt, its text decoder
    "smollm3": 3_075_098_624,  # SmolLM3-3B
    "olmo2": 7_298_617_344,  # OLMo-2-1124-7B
    # whisper-tiny: transformers' WhisperForConditionalGeneration(WhisperConfig()) on the
    # meta device, 37,760,640, less the encoder's frozen sinusoids (1500 x 384), which
    # tfjax computes instead of storing
    "whisper": 37_760_640 - 1500 * 384,
}
ALL = sorted(p.stem for p in CONFIGS.glob("*.py") if not p.stem.startswith("_"))


def n_params(model_cfg):
    abstract = nnx.eval_shape(lambda: models.build(model_cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def test_the_required_presets_exist():
    required = {"gpt2", "llama", "mistral", "gemma2", "neox", "bloom", "bert", "t5", "transformer"}
    assert required <= set(ALL)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_full_size_parameter_count(name):
    preset, _, variant = name.partition(":")
    cfg = run_config(load(preset).get_config(variant or None))
    assert n_params(cfg.model) == PARAMS[name]


# Presets whose runs read a checkpoint no preset can ship (the DPO reference's starting
# policy, the distillation teacher): a placeholder path, never opened here.
CHECKPOINTS = {"dpo": ("init_from",), "distill": ("train.teacher",)}


@pytest.mark.parametrize("name", ALL)
def test_tiny_forward_backward(name):
    module = load(name)
    assert module.__doc__ and "tiny" in module.__doc__, "docstring says how to run it"
    preset = module.get_config("tiny")
    for field in CHECKPOINTS.get(name, ()):
        *sections, last = field.split(".")
        section = preset
        for s in sections:
            section = section[s]
        section[last] = "CHECKPOINT"
    cfg = run_config(preset).model
    model = models.build(cfg, rngs=nnx.Rngs(0))
    B, T = 2, 12
    x = jax.random.randint(jax.random.key(0), (B, T), 0, cfg.vocab_size)

    def loss(m):
        if cfg.audio.n_mels:  # a speech model: log-mel features into the encoder
            feats = jax.random.normal(jax.random.key(1), (B, cfg.audio.n_mels, 2 * T))
            logits = m(x[:, :7], input_features=feats)
        elif cfg.arch == "encoder_decoder":
            logits = m(x, x[:, :7])
        elif cfg.arch == "encoder":
            logits = m(x, attention_mask=jnp.ones_like(x))
        else:
            logits = m(x)
        return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

    (value, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    assert logits.shape[-1] == cfg.vocab_size
    assert np.isfinite(float(value))
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)


def test_unknown_variant_is_an_error():
    with pytest.raises(ValueError, match="tiny"):
        load("llama").get_config("huge")


def test_presets_import_from_any_directory(tmp_path):
    """`from configs import llama` in a script anywhere (the installed `configs`
    package), not only from the repository root."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = tmp_path / "script.py"
    script.write_text("from configs import llama\nprint(llama.get_config('tiny').model.arch)\n")
    for cwd in (CONFIGS.parent / "experiments", tmp_path):
        out = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "decoder", out.stderr
