"""LoRA (Hu et al. 2021): fine-tune by training, for each targeted matrix W, two small
adapters A `[batch..., in..., r]` and B `[batch..., r, out...]` with W frozen; the model
computes with W + (alpha / r) * A @ B, merged in parameter space each step.

    python -m tfjax.train --config configs/finetune.py --workdir W \\
        --config.init_from=DIR --config.lora.rank=8 --config.lora.alpha=16 \\
        --config.lora.targets=attn,mlp

`TARGETS` maps target names (`GROUPS`: attn, mlp, all) to kernel paths and PEFT module
names; `Lora` makes, initialises and merges the adapters; `write_peft` writes them in
PEFT's format. See docs/training.md ("LoRA" and "LoRA: design").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import string
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.config import LoraConfig, RunConfig
from tfjax.interop import hf
from tfjax.interop.safetensors_io import save_file
from tfjax.parallel.rules import variable_axes
from tfjax.train.optim import make_optimizer, muon_dims

__all__ = ["GROUPS", "TARGETS", "Lora", "model_params", "parse_targets", "train_state_shape",
           "write_peft"]

# name -> (path suffixes of the kernels it adapts, PEFT / HF Llama module name)
TARGETS: dict[str, tuple[tuple[tuple[str, ...], ...], str]] = {
    "q": ((("attn", "q", "kernel"),), "q_proj"),
    "k": ((("attn", "k", "kernel"),), "k_proj"),
    "v": ((("attn", "v", "kernel"),), "v_proj"),
    "o": ((("attn", "o", "kernel"),), "o_proj"),
    "gate": ((("ffn", "wi_gate", "kernel"),), "gate_proj"),
    "up": ((("ffn", "wi_up", "kernel"), ("ffn", "wi", "kernel")), "up_proj"),
    "down": ((("ffn", "wo", "kernel"),), "down_proj"),
}
GROUPS = {"attn": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down"),
          "all": ("q", "k", "v", "o", "gate", "up", "down")}


def parse_targets(text: str) -> tuple[str, ...]:
    """"attn,down" -> ("q", "k", "v", "o", "down"); an unknown name is a ValueError
    naming `lora.targets` and the known names."""
    out: list[str] = []
    for name in (t.strip() for t in text.split(",")):
        if not name:
            continue
        if name not in TARGETS and name not in GROUPS:
            raise ValueError(f"lora.targets: unknown name {name!r}; use {', '.join(TARGETS)} "
                             f"or the groups {', '.join(GROUPS)} (comma-separated)")
        out += [n for n in GROUPS.get(name, (name,)) if n not in out]
    return tuple(out)


def _path_str(path) -> str:
    return "/".join(map(str, path))


@dataclasses.dataclass(frozen=True)
class _Site:
    """One adapted kernel: its path, target name and its batch (stacking), input
    (contracted) and output axes."""

    path: tuple
    target: str
    batch: tuple[int, ...]
    inp: tuple[int, ...]
    out: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Lora:
    """The adapters of one model: rank, scale alpha / rank, and the adapted kernels."""

    rank: int
    alpha: float
    sites: tuple[_Site, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, cfg: LoraConfig, params) -> Lora | None:
        """The adapters `cfg` asks for on the parameter tree `params` (abstract or
        concrete); None when `cfg.rank` is 0. A target that matches no kernel is a
        ValueError naming `lora.targets` (before anything compiles)."""
        if not cfg.rank:
            return None
        names = parse_targets(cfg.targets)
        flat = list(nnx.to_flat_state(params))
        sites, hit = [], set()
        for path, var in flat:
            for name in names:
                if any(tuple(path[-len(s):]) == s for s in TARGETS[name][0]):
                    d = muon_dims(var)
                    if d is None:
                        raise ValueError(f"lora.targets: {_path_str(path)} ({name!r}) is not a "
                                         f"matrix by its logical axes {variable_axes(var)}")
                    inp, out = tuple(np.atleast_1d(d.reduction_axis)), tuple(
                        np.atleast_1d(d.output_axis))
                    nd = var.get_value().ndim
                    batch = tuple(i for i in range(nd) if i not in inp + out)
                    sites.append(_Site(tuple(path), name, batch, tuple(map(int, inp)),
                                       tuple(map(int, out))))
                    hit.add(name)
        if missing := [n for n in names if n not in hit]:
            kernels = [_path_str(p) for p, _ in flat if p[-1] == "kernel"][:4]
            them = "them" if len(missing) > 1 else "it"
            raise ValueError(
                f"lora.targets: {', '.join(map(repr, missing))} match no parameter of this "
                f"model (its kernels: {', '.join(kernels)}, ...); drop {them} from "
                f"--config.lora.targets (see tfjax.train.lora.TARGETS)")
        return cls(cfg.rank, float(cfg.alpha or cfg.rank), tuple(sites))

    # ------------------------------------------------------------ shapes
    def _shapes(self, site: _Site, var) -> tuple[tuple, tuple, tuple, tuple]:
        """(A shape, A names, B shape, B names) for the kernel `var` at `site`."""
        shape = var.get_value().shape
        names = variable_axes(var) or (None,) * len(shape)
        r, ax = self.rank, site.batch + site.inp
        a_shape = tuple(shape[i] for i in ax) + (r,)
        a_names = tuple(names[i] for i in ax) + (None,)
        b_shape = tuple(shape[i] for i in site.batch) + (r,) + tuple(shape[i] for i in site.out)
        b_names = tuple(names[i] for i in site.batch) + (None,) + tuple(names[i] for i in site.out)
        return a_shape, a_names, b_shape, b_names

    def _kernels(self, params) -> dict[tuple, Any]:
        flat = dict(nnx.to_flat_state(params))
        return {s.path: flat[s.path] for s in self.sites}

    def _adapters(self, params, make) -> nnx.State:
        """The adapter State: `make(site, kind, shape, dtype, index)` gives each value."""
        out = []
        for i, (site, var) in enumerate(zip(self.sites, self._kernels(params).values())):
            a_shape, a_names, b_shape, b_names = self._shapes(site, var)
            dtype = var.get_value().dtype
            for kind, shape, names in (("lora_a", a_shape, a_names), ("lora_b", b_shape, b_names)):
                out.append((site.path + (kind,),
                            nnx.LoRAParam(make(site, kind, shape, dtype, i), out_sharding=names,
                                          eager_sharding=False)))
        return nnx.from_flat_state(out)

    def abstract(self, aparams) -> nnx.State:
        """The adapters' abstract State (ShapeDtypeStructs) for the base tree `aparams`."""
        return self._adapters(aparams, lambda s, k, shape, dt, i: jax.ShapeDtypeStruct(shape, dt))

    def init(self, params, key) -> nnx.State:
        """Fresh adapters: A uniform in +-1/sqrt(fan_in) (PEFT's kaiming_uniform(a=sqrt(5))),
        B zeros (so the model starts as the base)."""
        def make(site, kind, shape, dtype, i):
            if kind == "lora_b":
                return jnp.zeros(shape, dtype)
            fan_in = math.prod(shape[len(site.batch):-1])
            bound = 1.0 / math.sqrt(fan_in)
            return jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound,
                                      bound).astype(dtype)
        return self._adapters(params, make)

    def delta(self, site: _Site, a, b, ndim: int):
        """s * A @ B laid out as the kernel (batch axes matched, not summed)."""
        letters = iter(string.ascii_letters.replace("r", ""))
        k = [next(letters) for _ in range(ndim)]
        sa = "".join(k[i] for i in site.batch + site.inp) + "r"
        sb = "".join(k[i] for i in site.batch) + "r" + "".join(k[i] for i in site.out)
        return self.scale * jnp.einsum(f"{sa},{sb}->{''.join(k)}", a, b,
                                       preferred_element_type=jnp.float32)

    def merge(self, params, adapters):
        """The base `params` with every adapted kernel replaced by W + s * A @ B (in the
        kernel's dtype); every other parameter is the base's own array."""
        ad = dict(nnx.to_flat_state(adapters))
        out = []
        for path, var in nnx.to_flat_state(params):
            if (path + ("lora_a",)) in ad:
                site = next(s for s in self.sites if s.path == path)
                w = var.get_value()
                d = self.delta(site, ad[path + ("lora_a",)].get_value(),
                               ad[path + ("lora_b",)].get_value(), w.ndim)
                var = var.replace((w.astype(jnp.float32) + d).astype(w.dtype))
            out.append((path, var))
        return nnx.from_flat_state(out)

    def summary(self, aparams) -> str:
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract(aparams)))
        total = sum(math.prod(x.shape) for x in jax.tree.leaves(aparams))
        targets = ",".join(dict.fromkeys(s.target for s in self.sites))
        return (f"LoRA rank {self.rank} alpha {self.alpha:g} on {len(self.sites)} kernels "
                f"({targets}): {n:,} trainable parameters ({100 * n / total:.3f}% of {total:,}); "
                f"the base is frozen")


def train_state_shape(cfg: RunConfig, aparams, arest):
    """(abstract train state, Lora or None, optimizer) of a run whose model has the
    abstract parameters `aparams`: {step, params, opt, rest} and, with LoRA, `frozen`
    (the base; `params` the adapters, the optimizer over them alone)."""
    lora = Lora.of(cfg.lora, aparams)
    tx = make_optimizer(cfg.train, cfg.model)
    trainable = aparams if lora is None else lora.abstract(aparams)
    state = dict(step=jax.ShapeDtypeStruct((), jnp.int32), params=trainable,
                 opt=jax.eval_shape(tx.init, trainable), rest=arest)
    if lora is not None:
        state["frozen"] = aparams
    return state, lora, tx


def model_params(lora: Lora | None, state):
    """The parameters the model computes with: `state["params"]`, or with LoRA the
    frozen base merged with the adapters."""
    return state["params"] if lora is None else lora.merge(state["frozen"], state["params"])


def write_peft(lora: Lora, cfg: RunConfig, state, out: str, dtype=None) -> None:
    """Write the adapters of a Llama-family LoRA run in PEFT's format: `out/
    adapter_config.json` + `out/adapter_model.safetensors`, for
    `peft.PeftModel.from_pretrained(base, out)` on the base model `init_from` names
    (lora_A `[r, in]`, lora_B `[out, r]`, scaling lora_alpha / r)."""
    m = cfg.model
    hf._check_llama_exportable(m)
    ad = dict(nnx.to_flat_state(state["params"]))
    out_dtype = np.dtype(jnp.dtype(dtype or m.param_dtype))
    tensors: dict[str, np.ndarray] = {}
    modules = set()
    r = lora.rank
    for i in range(m.num_layers):
        for name, (suffixes, module) in TARGETS.items():
            path, idx = hf._target(m, ("layers", i, *suffixes[0]))
            if path + ("lora_a",) not in ad:
                continue
            a = np.asarray(jax.device_get(ad[path + ("lora_a",)].get_value()))
            b = np.asarray(jax.device_get(ad[path + ("lora_b",)].get_value()))
            if idx is not None:
                a, b = a[idx], b[idx]
            block = "self_attn" if suffixes[0][0] == "attn" else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = a.reshape(-1, r).T
            tensors[f"{key}.lora_B.weight"] = b.reshape(r, -1).T
            modules.add(module)
    os.makedirs(out, exist_ok=True)
    save_file({k: np.ascontiguousarray(v.astype(out_dtype)) for k, v in tensors.items()},
              os.path.join(out, "adapter_model.safetensors"))
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=r, lora_alpha=lora.alpha,
                  target_modules=sorted(modules), lora_dropout=0.0, bias="none",
                  fan_in_fan_out=False, use_rslora=False, init_lora_weights=True,
                  inference_mode=True, modules_to_save=None,
                  base_model_name_or_path=cfg.init_from or None)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
