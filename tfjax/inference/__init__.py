"""Fast inference: the model's cache, slot arithmetic, sampling and the decode loops.

    from tfjax.inference import generate
    out = generate(model, prompt_tokens, max_new_tokens=32, prompt_lengths=lengths,
                   temperature=0.8, top_k=40, top_p=0.95, eos_id=eos, seed=0)

`slots`, `cache` (`ModelCache`), `sampling`, `generate` (`generate`, `stream`) and
`speculative` (`speculative_generate`); the model makes its own empty cache
(`model.init_cache(batch, max_len)`). The command line is `python -m tfjax.generate`.
See docs/inference.md.
"""

from tfjax.inference import cache, sampling, slots
from tfjax.inference.cache import ModelCache
from tfjax.inference.generate import generate, stream
from tfjax.inference.sampling import SamplingParams, filter_logits, sample, sample_rows
from tfjax.inference.speculative import speculative_generate

__all__ = ["ModelCache", "SamplingParams", "cache", "filter_logits", "generate", "sample",
           "sample_rows", "sampling", "slots", "speculative_generate", "stream"]
