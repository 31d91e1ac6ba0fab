"""tfjax: every component of the Transformer family in JAX / Flax NNX.

    import tfjax
    cfg = tfjax.config.model_config(get_config("tiny").model)
    model = tfjax.models.build(cfg, rngs=nnx.Rngs(0))
    logits = model(tokens)

Subpackages: `ops` (attention entry point, masks, kernels), `nn` (layers),
`models` (architectures), `parallel` (mesh, sharding), `train`, `data`,
`inference`, `interop`.
"""

from tfjax import platforms

platforms.cpu_without_accelerators()  # no libtpu start-up noise on CPU-only machines

from tfjax import config, models, nn, ops  # noqa: E402
from tfjax.ops import dot_product_attention

__version__ = "0.1.0"
__all__ = ["config", "models", "nn", "ops", "dot_product_attention", "__version__"]
