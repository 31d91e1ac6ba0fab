"""The sharded jit trainer: one loop (`trainer.py`), a pure step (`step.py`), AdamW
(`optim.py`), masked losses (`losses.py`), orbax checkpoints (`checkpoint.py`),
metrics (`metrics.py`) and the objectives every architecture trains with
(`objectives.py`). Run it with `python -m tfjax.train --config configs/default.py`."""

from tfjax.train.metrics import compression_bits_per_byte
from tfjax.train.objectives import OBJECTIVES
from tfjax.train.trainer import Trainer, check_run

__all__ = ["OBJECTIVES", "Trainer", "check_run", "compression_bits_per_byte"]
