"""The Hugging Face checkpoint families, one module each (`llama.py`, `qwen3.py`, ...):
how a family's `config.json` and tensors come into tfjax and go back out. Each module
exports `FAMILY`, a `Family` record; `tfjax.interop.hf.FAMILIES` is the one table of
them (nothing registers itself). See docs/howto/checkpoint_family.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tfjax.config import ModelConfig
from tfjax.interop.tensor_mapping import Weights

__all__ = ["Family"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One checkpoint family: the `model_type`s it answers to and how it goes in and out.

    model_types: the `config.json` `model_type` names it reads ("llama", "mistral").
    config: `config(hf) -> dict`, the `ModelConfig` fields of a `config.json` dict
      (sections as nested dicts); an option that changes the computation is mapped or
      refused with NotImplementedError naming it.
    weights: `weights(w, cfg, hf) -> {our parameter path: array}` from the checkpoint
      (`w`, a `Weights`), per-layer paths `(stack, i, ...)`; element movement only, so
      that export runs it backwards (`tfjax.interop.hf_invert`).
    to_hf: `to_hf(cfg) -> config.json dict` (model_type, architectures and every field
      `config` reads), the inverse of `config`, which makes the family exportable; None:
      load only.
    prefix: the module prefix of its causal-LM checkpoint ("model."), which a bare
      base-model checkpoint lacks; "" where there is none to drop.
    mtp_depth: `mtp_depth(hf, tensor names) -> int`, the `model.mtp_depth` its tensors
      hold (multi-token-prediction modules); None: none.
    build: `build(hf, tensors, scan_layers=, dtype=) -> model` for a family whose model
      is not `tfjax.models.build(cfg)`'s (mllama: a vision model beside the decoder),
      placing `weights`' arrays itself; None: `build`'s model, placed by
      `tfjax.interop.hf.load_state`.
    """

    model_types: tuple[str, ...]
    config: Callable[[dict], dict]
    weights: Callable[[Weights, ModelConfig, dict], dict]
    to_hf: Callable[[ModelConfig], dict] | None = None
    prefix: str = ""
    mtp_depth: Callable[[dict, Any], int] | None = None
    build: Callable[..., Any] | None = None
