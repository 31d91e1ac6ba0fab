"""Interoperability with other frameworks' checkpoints (Hugging Face: `tfjax.interop.hf`)."""

from tfjax.interop import hf
from tfjax.interop.hf import export, load

__all__ = ["hf", "load", "export"]
