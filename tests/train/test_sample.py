"""`Trainer.sample` (KV-cached: `tfjax.inference.generate`) gives exactly the tokens of
the uncached greedy loop, which recomputes the logits of the whole prefix for every
new token: a tiny trained model on one device and on meshes of 8 devices, a prefix-LM,
and prompts that reach `train.seq_len`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from tiny_setup import devices, tiny_config

from tfjax.train import Trainer

SHORT = "def "
LONG = "import os\nclass Path(object):\n"  # 31 tokens with BOS: 1 left of seq_len=32
TOO_LONG = "x = [1, 2, 3]\n" * 3  # more than seq_len: the prompt is cut, nothing is generated
PROMPTS = {"short": (SHORT, 20), "fills_window": (LONG, 20), "too_long": (TOO_LONG, 20)}


@functools.partial(jax.jit, static_argnames="graphdef")
def _last_logits(graphdef, variables, ids, length, prefix):
    """Logits at position `length - 1` of `ids [1, T]` (right padding after it is
    invisible to a causal or prefix-LM model), recomputed over the whole prefix."""
    model = nnx.merge(graphdef, variables)
    kw = dict(prefix_lengths=prefix) if model.config.prefix_lm else {}
    return model(ids, **kw)[0, length - 1]


def uncached_greedy(tr, state, prompt: str, num_tokens: int) -> list[int]:
    """The reference: `[bos] + encode(prompt)`, then argmax of the last position's logits
    over the whole prefix, one forward per token, up to EOS, within train.seq_len; a
    prefix-LM takes the prompt (with its BOS) as the bidirectional prefix."""
    tok, T = tr.tokenizer, tr.cfg.train.seq_len
    graphdef, variables = nnx.split(tr.model(state))
    variables = jax.device_get(variables)  # one device, no mesh
    ids = [tok.bos_id] + list(tok.encode(prompt))[: T - 1]
    prefix = jnp.array([len(ids)])
    for _ in range(min(num_tokens, T - len(ids))):
        padded = jnp.asarray([ids + [0] * (T - len(ids))])
        nxt = int(jnp.argmax(_last_logits(graphdef, variables, padded, len(ids), prefix)))
        if nxt == tok.eos_id:
            break
        ids.append(nxt)
    return ids[1:]


def sampled_ids(tr, state, prompt: str, num_tokens: int, monkeypatch) -> list[int]:
    """The ids `Trainer.sample` decodes (its text, before the tokenizer turns them into it)."""
    with monkeypatch.context() as m:
        m.setattr(tr.tokenizer, "decode", list)
        return tr.sample(state, prompt, num_tokens)


def trained(tmp_path, prefix_lm=False):
    """A tiny real model (`tfjax.models.build`) after 8 steps on one device; drawn with a
    large init_std, so that its greedy continuations vary from token to token (a
    shifted or dropped token shows)."""
    cfg = tiny_config(model=dict(init_std=0.5, prefix_lm=prefix_lm),
                      train=dict(steps=8, objective="prefix_lm" if prefix_lm else "causal_lm"))
    tr = Trainer(cfg, str(tmp_path / "w"), devices=devices(1), log=lambda s: None)
    tr.train()
    return tr, tr.state


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("causal"))


@pytest.mark.parametrize("case", list(PROMPTS))
def test_sample_is_the_uncached_greedy_loop(causal, case, monkeypatch):
    tr, state = causal
    prompt, n = PROMPTS[case]
    want = uncached_greedy(tr, state, prompt, n)
    got = sampled_ids(tr, state, prompt, n, monkeypatch)
    assert got == want
    assert tr.sample(state, prompt, n) == tr.tokenizer.decode(want)
    assert 1 + len(got) <= tr.cfg.train.seq_len  # BOS, prompt and continuation fit
    if case == "short":  # it did continue, and not with one token over and over
        assert len(set(got[len(tr.tokenizer.encode(prompt)):])) > 2, got


@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2, tensor=2), dict(data=4, sequence=2)],
                         ids=["d2f2t2", "d4s2"])
def test_sample_on_a_mesh(tmp_path, causal, mesh, monkeypatch):
    """The one-device run's state placed on 8 devices: the same tokens (the prompt one
    row per batch shard, parameters sharded as the mesh's trainer holds them)."""
    one, state = causal
    tr = Trainer(dataclasses.replace(one.cfg, mesh=dataclasses.replace(one.cfg.mesh, **mesh)),
                 str(tmp_path / "m"), devices=devices(8), log=lambda s: None)
    placed = jax.device_put(jax.device_get(state), tr.program.state_shardings)
    for prompt, n in PROMPTS.values():
        assert sampled_ids(tr, placed, prompt, n, monkeypatch) == uncached_greedy(
            one, state, prompt, n)


def test_prefix_lm_sample_reads_the_prompt_both_ways(tmp_path, monkeypatch):
    tr, state = trained(tmp_path, prefix_lm=True)
    for prompt, n in PROMPTS.values():
        assert sampled_ids(tr, state, prompt, n, monkeypatch) == uncached_greedy(
            tr, state, prompt, n)
