"""Look inside a model: activations by TransformerLens's hook names, kept
(`run_with_cache`) or replaced (`run_with_hooks`), through the scanned stack and jit.

    logits, cache = run_with_cache(model, tokens)            # cache["blocks.0.attn.hook_pattern"]
    logits = run_with_hooks(model, tokens, fwd_hooks=[("blocks.1.attn.hook_z", ablate)])

See docs/interp.md.
"""

from tfjax.interp.analysis import (ablate_heads, direct_logit_attribution, logit_attribution,
                                    logit_lens, patching_sweep)
from tfjax.interp.runs import hook_names, run_with_cache, run_with_hooks
from tfjax.nn.hooks import HookPoint

__all__ = ["HookPoint", "ablate_heads", "direct_logit_attribution", "hook_names", "logit_attribution",
           "logit_lens", "patching_sweep", "run_with_cache", "run_with_hooks"]
