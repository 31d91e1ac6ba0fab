"""Axis-letter glossary and array type aliases used across tfjax.

Every einsum string, shape comment and parameter name uses these letters:

    B  batch                 T  query length          S  key/value length
    N  query heads           K  key/value heads       G  query heads per kv head (N // K)
    H  head dim              D  model dim             F  feed-forward dim
    V  vocabulary            E  experts               L  layers

Shape comments are written `# [B, T, K, G, H]`.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int  # noqa: F401  (re-exported)

PRNGKey: TypeAlias = jax.Array
Shape: TypeAlias = tuple[int, ...]
DType: TypeAlias = Any  # a jnp dtype or its name
ArrayLike: TypeAlias = jax.Array | np.ndarray

# Common tensors, by axis letters.
Tokens: TypeAlias = Int[Array, "B T"]
Positions: TypeAlias = Int[Array, "B T"]
SegmentIds: TypeAlias = Int[Array, "B T"]
Hidden: TypeAlias = Float[Array, "B T D"]
Logits: TypeAlias = Float[Array, "B T V"]
Queries: TypeAlias = Float[Array, "B T N H"]
Keys: TypeAlias = Float[Array, "B S K H"]
Values: TypeAlias = Float[Array, "B S K H"]
