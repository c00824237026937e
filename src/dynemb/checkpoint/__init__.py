"""Checkpoints of dynemb tables: one open format (docs/format.md), full and delta saves,
crash-safe commits, checked loads that work across index geometries.

K keys of a table, D embedding dim, S optimizer state columns.

    dynemb.checkpoint.save(model, "ckpt/full-000")
    dynemb.checkpoint.save_delta(model, "ckpt/delta-001", base="ckpt/full-000")
    dynemb.checkpoint.load(model, "ckpt/delta-001")        # follows the chain to the full save

Only dynemb tables are saved (every DynamicTable and every table of a collection in the module
tree); dense parameters stay with the user's own checkpointing (``torch.save(model.state_dict())``
minus the tables, or ``dense=True`` to store ``model``'s other state_dict entries too).
"""

from dynemb.checkpoint.chain import chain_of
from dynemb.checkpoint.loading import load
from dynemb.checkpoint.saving import save, save_delta
from dynemb.errors import CheckpointError

__all__ = ["CheckpointError", "chain_of", "load", "save", "save_delta"]
