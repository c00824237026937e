"""torch.distributed.checkpoint (DCP) for modules holding dynemb tables, on one process.

K keys of a table (saved), D embedding dim, S optimizer state columns.

A dynemb table's ``state_dict()`` is plain tensors whose sizes follow its key count (``keys``
[K], ``embeddings`` [K, D], ``optimizer_state`` [K, S], index and admission entries), so
``dcp.save`` needs nothing special. ``dcp.load`` however loads *in place* into the tensors of a
template (the ``state_dict()`` of the module being loaded), and a fresh table holds other sizes
than the saved one (K = 0). :class:`Stateful` wraps the module; :func:`prepare_load` reads the
sizes saved in the checkpoint's DCP metadata and makes the wrapper's template take them, after
which ``dcp.load`` reads the saved tensors and hands them to the module's ``load_state_dict``
(which restores the tables exactly, or re-inserts the keys into tables of another geometry)::

    import torch.distributed.checkpoint as dcp
    from dynemb.checkpoint.dcp import Stateful, prepare_load

    dcp.save({"model": Stateful(model)}, checkpoint_id="ckpt/dcp-000")    # or {"model": model}

    state = {"model": Stateful(model)}
    prepare_load(state, "ckpt/dcp-000")
    dcp.load(state, checkpoint_id="ckpt/dcp-000")

Without a process group DCP works on one process (it warns that it assumes so). The wrapper
covers the module's whole ``state_dict`` (dense parameters too); only entries of dynemb tables
take the saved sizes, so a dense parameter of another shape still fails as DCP reports it.
"""

from __future__ import annotations

import os

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dynemb.checkpoint import dcp_sharded
from dynemb.checkpoint.dcp_sharded import even_block, sharded_rows, table_prefixes

__all__ = ["Stateful", "prepare_load"]


class Stateful:
    """A module as a ``torch.distributed.checkpoint.stateful.Stateful`` whose dynemb tables can be
    loaded by ``dcp.load`` (after :func:`prepare_load`).

    Args:
        module: any module tree holding DynamicTables or collections (itself may be one).
        strict: passed to ``module.load_state_dict``.
    """

    def __init__(self, module: torch.nn.Module, *, strict: bool = True):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module={module!r}: must be a torch.nn.Module")
        self.module = module
        self.strict = strict
        # Entry name -> (size, dtype) saved in the checkpoint about to be loaded.
        self._saved: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state_dict; after :func:`prepare_load`, each table entry whose saved size
        differs is an empty tensor of the saved size and dtype, for DCP to load into. A sharded
        model's tables are row-sharded tensors instead (see :mod:`dynemb.checkpoint.dcp_sharded`)."""
        if dcp_sharded.is_sharded_model(self.module):
            return dcp_sharded.state_dict(self.module, self._saved)
        state = self.module.state_dict()
        if self._saved:
            prefixes = table_prefixes(self.module)
            for name, value in state.items():
                saved = self._saved.get(name)
                if saved is not None and isinstance(value, torch.Tensor) and name.startswith(prefixes) and (value.shape, value.dtype) != saved:
                    state[name] = torch.empty(saved[0], dtype=saved[1], device=value.device)
        return state

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._saved = {}
        if dcp_sharded.is_sharded_model(self.module):
            dcp_sharded.load_state_dict(self.module, state_dict, strict=self.strict)
            return
        self.module.load_state_dict(state_dict, strict=self.strict)

    def template_from(self, metadata: Metadata, key: str) -> None:
        """Take the sizes of this wrapper's entries from a DCP checkpoint's ``metadata``, where
        the wrapper was saved under the top-level ``key`` of the state dict."""
        saved = {}
        planner_data = metadata.planner_data or {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            path = planner_data.get(fqn)
            if path is not None:
                if len(path) != 2 or path[0] != key:
                    continue
                name = path[1]
            elif fqn.startswith(key + "."):
                name = fqn[len(key) + 1 :]
            else:
                continue
            saved[name] = (md.size, md.properties.dtype)
        self._saved = saved


def prepare_load(state_dict: dict, checkpoint_id: str | os.PathLike | None = None, *, storage_reader=None) -> None:
    """Size the templates of every :class:`Stateful` in ``state_dict`` (the dict about to be
    passed to ``dcp.load``) from the checkpoint's metadata, and the row-sharded table entries of
    a DMP model's ``state_dict()`` in it (an even split of the saved rows; collective).

    Args:
        state_dict: the dict for ``dcp.load``; its :class:`Stateful` values are prepared.
        checkpoint_id: the checkpoint's directory (read with ``FileSystemReader``), or
        storage_reader: a DCP ``StorageReader`` of the checkpoint.
    """
    if (checkpoint_id is None) == (storage_reader is None):
        raise ValueError("prepare_load needs exactly one of checkpoint_id and storage_reader")
    reader = storage_reader if storage_reader is not None else FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    for key, value in state_dict.items():
        if isinstance(value, Stateful):
            value.template_from(metadata, key)
        elif isinstance(value, torch.nn.Module) and table_prefixes(value):
            raise TypeError(f"state_dict[{key!r}] is a module holding dynemb tables: wrap it as dynemb.checkpoint.dcp.Stateful(module) to load it with DCP")
    _retemplate_rows(state_dict, metadata, "")


# The row-sharded entries of a table in a DMP model's state_dict() (dcp_sharded.table_state).
_ROW_ENTRIES = ("keys", "embeddings", "optimizer_state", "scores")


def _retemplate_rows(state: dict, metadata: Metadata, prefix: str) -> None:
    """Each row-sharded table entry of ``state`` (nested dicts included: DCP flattens them with
    dots) whose saved row count differs becomes an even split of the saved rows over the ranks
    (collective: every rank prepares the same dict)."""
    for key, value in list(state.items()):
        fqn = f"{prefix}{key}"
        if isinstance(value, dict):
            _retemplate_rows(value, metadata, f"{fqn}.")
            continue
        if not isinstance(value, ShardedTensor) or str(key).rsplit(".", 1)[-1] not in _ROW_ENTRIES:
            continue
        saved = metadata.state_dict_metadata.get(fqn)
        if not isinstance(saved, TensorStorageMetadata) or tuple(saved.size) == tuple(value.size()):
            continue
        n = saved.size[0]
        lo, hi = even_block(n)
        state[key] = sharded_rows(torch.empty(hi - lo, *saved.size[1:], dtype=saved.properties.dtype), lo, n)
