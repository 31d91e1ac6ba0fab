"""Fast inference: KV caches, jitted prefill + decode, sampling.

    from tfjax.inference import generate
    out = generate(model, prompt_tokens, max_new_tokens=32, prompt_lengths=lengths,
                   temperature=0.8, top_k=40, top_p=0.95, eos_id=eos, seed=0)

`kv_cache` (per-layer-kind caches: K/V for attention, O(1) states for Mamba and
linear attention; the decode mask, cache sizes), `sampling` (greedy / temperature /
top-k / top-p), `generate` (prefill, optionally in chunks, + decode loop, streaming).
The command line is `python -m tfjax.generate --workdir DIR --prompt "..."`.
"""

from tfjax.inference import kv_cache, sampling
from tfjax.inference.generate import generate, stream
from tfjax.inference.kv_cache import (CACHE_KINDS, CacheKind, KVCache, LinearCache, MambaCache,
                                      ModelCache, cache_bytes, init_cache, kv_bytes_per_token)
from tfjax.inference.sampling import filter_logits, sample

__all__ = ["CACHE_KINDS", "CacheKind", "KVCache", "LinearCache", "MambaCache", "ModelCache",
           "cache_bytes", "filter_logits", "generate", "init_cache", "kv_bytes_per_token",
           "kv_cache", "sample", "sampling", "stream"]
