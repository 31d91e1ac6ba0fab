"""orbax checkpoints of the whole run: train state (params, optimizer, step, model
RNG state) and the data iterator's position.

Saves are asynchronous (training continues while arrays are written) and atomic:
orbax writes into a temporary directory and renames it when complete, and
`latest_step()` only sees finished steps, so a half-written checkpoint (killed
mid-save) is never restored. The last `keep` checkpoints are kept. Restoring takes
the target shardings of the *current* mesh, so a checkpoint written on one mesh
shape restores onto another.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from tfjax.config import CheckpointConfig

__all__ = ["Checkpointer"]


class Checkpointer:
    def __init__(self, workdir: str, cfg: CheckpointConfig):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True,
            cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, *, wait: bool = False) -> None:
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)
        if wait:
            self.manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int] | None:
        """Restore `step` (default: the latest finished one) onto the shardings in
        `abstract_state` (a tree of ShapeDtypeStructs with `.sharding`); None if none."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return out["state"], dict(out["data"]), step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract, shardings)
