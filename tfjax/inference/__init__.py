"""Fast inference: KV caches, jitted prefill + decode, sampling.

    from tfjax.inference import generate
    out = generate(model, prompt_tokens, max_new_tokens=32, prompt_lengths=lengths,
                   temperature=0.8, top_k=40, top_p=0.95, eos_id=eos, seed=0)

`kv_cache` (the per-layer states: K/V for attention, O(1) states for Mamba, Mamba-2,
linear attention and Gated DeltaNet; the slot positions the model builds its decode masks
from), `sampling` (greedy / temperature / top-k / top-p), `generate` (prefill, optionally
in chunks, + decode loop, streaming), `speculative` (self-speculative greedy decoding
with a model's multi-token prediction modules as the draft). This package sits below `tfjax.models`: a
model makes its own empty cache (`model.init_cache(batch, max_len)`) and counts its
bytes (`tfjax.models.cache_bytes(cfg, batch, length)`), since both follow its layer
kinds and its layer stack's layout. The command line is
`python -m tfjax.generate --workdir DIR --prompt "..."`.
"""

from tfjax.inference import kv_cache, sampling
from tfjax.inference.generate import generate, stream
from tfjax.inference.kv_cache import (CrossKVCache, GatedDeltaNetCache, KVCache, LayerCache,
                                      LinearCache, Mamba2Cache, MambaCache, ModelCache)
from tfjax.inference.sampling import filter_logits, sample
from tfjax.inference.speculative import speculative_generate

__all__ = ["CrossKVCache", "GatedDeltaNetCache", "KVCache", "LayerCache", "LinearCache",
           "Mamba2Cache", "MambaCache", "ModelCache", "filter_logits", "generate", "kv_cache",
           "sample", "sampling", "speculative_generate", "stream"]
