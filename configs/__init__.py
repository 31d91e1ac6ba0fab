"""tfjax's presets: one module per family, each `get_config(arg=None) -> ConfigDict`
(`arg` a variant such as "tiny"). Installed with tfjax (`pip install -e .` from the
clone), so `from configs import llama` works from any directory; the trainer takes a
preset by path: `python -m tfjax.train --config configs/llama.py:tiny`."""
