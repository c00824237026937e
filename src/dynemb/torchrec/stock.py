"""Rows between TorchRec's stock tables and dynemb's: a stock table of ``num_embeddings`` rows is
the dynemb table whose keys are 0..num_embeddings-1 (row i of the stock weight is key i).

N rows of a stock table (its num_embeddings), D embedding dim, K keys asked for.

- :func:`copy_stock_rows` puts a stock weight into a dynemb table (``convert()`` and the load
  hook below call it);
- :func:`load_stock_entries` lets a drop-in EBC / EC load a stock module's ``state_dict``
  (``embedding_bags.<table>.weight`` / ``embeddings.<table>.weight``);
- :func:`to_stock_weight` and :func:`to_stock_state_dict` are the way back.

See docs/design/0028-torchrec-stock-rows.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torchrec
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from dynemb.errors import InsertionError
from dynemb.nn import DynamicTable, DynamicTables

# A hash index cannot place every key at a load of exactly 1 (docs/design/0006: the first key
# fails between 0.999 and 1.0 of the slots): a table that takes a stock weight gets 1/64 more.
HEADROOM = 64


def stock_capacity(num_embeddings: int) -> int:
    """The capacity ``convert()`` gives a table that takes ``num_embeddings`` stock rows."""
    return num_embeddings + -(-num_embeddings // HEADROOM)


def _layout(module: torch.nn.Module) -> tuple[str, dict[str, BaseEmbeddingConfig]]:
    """(name of the module's table dict, table name -> config) of a TorchRec EBC or EC."""
    if isinstance(module, torchrec.EmbeddingBagCollection):
        return "embedding_bags", {c.name: c for c in module.embedding_bag_configs()}
    if isinstance(module, torchrec.EmbeddingCollection):
        return "embeddings", {c.name: c for c in module.embedding_configs()}
    raise TypeError(f"module={type(module).__name__}: expected a TorchRec EmbeddingBagCollection or EmbeddingCollection")


def stock_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Table name -> the [N, D] weight of a stock TorchRec EBC / EC; empty when the module is
    on ``meta`` (no rows to copy)."""
    attr, configs = _layout(module)
    tables = module.get_submodule(attr)
    weights = {name: tables[name].weight for name in configs}
    if any(w.is_meta for w in weights.values()):
        return {}
    return weights


def _check_capacity(tables: DynamicTables, table: str, n: int) -> int:
    """The table's requested capacity; ValueError naming the table and both numbers when it is
    below the ``n`` stock rows it should take."""
    requested = tables.stats()[table]["requested_capacity"]
    if requested < n:
        raise ValueError(f"table {table!r}: capacity={requested} is smaller than its {n} stock rows (num_embeddings); give it a capacity >= {n}")
    return requested


def copy_stock_rows(tables: DynamicTables, table: str, weight: torch.Tensor) -> None:
    """Assign ``weight`` [N, D] to keys 0..N-1 of ``tables``' table ``table`` (public
    ``insert``; fresh optimizer state for keys the table did not hold). Raises ValueError naming
    the table when a row cannot be placed: no row is dropped silently."""
    n = weight.shape[0]
    requested = _check_capacity(tables, table, n)
    keys = torch.arange(n, dtype=torch.int64, device=weight.device)
    advice = f"give it options={{{table!r}: {{'capacity': {stock_capacity(n)}}}}} or more"
    try:
        placed = tables.insert(table, keys, weight.detach())
    except InsertionError as e:
        raise ValueError(f"table {table!r}: not every one of its {n} stock rows found a slot at capacity={requested}; {advice} ({e})") from None
    if not bool(placed.all()):
        raise ValueError(f"table {table!r}: {int((~placed).sum())} of its {n} stock rows found no slot at capacity={requested}; {advice}")


def _replace_with_stock_rows(tables: DynamicTables, table: str, weight: torch.Tensor) -> None:
    """The table holds exactly keys 0..N-1 with ``weight``'s rows afterwards: keys it held
    leave through the evict hooks (as erased), and every row starts with fresh optimizer state."""
    held = [chunk["keys"] for chunk in tables.export(table)]
    if held:
        tables.erase(table, torch.cat(held))
    copy_stock_rows(tables, table, weight)


def _keep_collection(module: torch.nn.Module, state_dict: dict, prefix: str) -> None:
    """Make the ``collection.*`` entries under ``prefix`` the collection's current state, so the
    collection (loaded after this hook) reloads what it holds and reports nothing missing."""
    own = prefix + "collection."
    for key in [k for k in state_dict if k.startswith(own)]:
        del state_dict[key]
    state_dict.update(module.collection.state_dict(prefix=own))


def load_stock_entries(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook of the drop-in EBC / EC: a stock module's entries
    ``<prefix>embedding_bags.<table>.weight`` (EBC) / ``<prefix>embeddings.<table>.weight`` (EC),
    ``[num_embeddings, D]``, replace the table's contents with keys 0..N-1 (fresh optimizer
    state: a stock module holds none). Without such entries nothing happens (the module's own
    ``collection.*`` entries load as usual).

    Both formats under one prefix raise (nothing changed); a table without an entry is a
    missing key (``strict=False``: it keeps its rows); entries that name no table stay for
    torch to report as unexpected; a wrong shape, a non-float or non-finite weight, or a
    table whose capacity is below N is an error naming it. All are checked before any table
    changes.
    """
    attr, configs = _layout(module)
    stock_prefix = f"{prefix}{attr}."
    entries = {name: state_dict.pop(f"{stock_prefix}{name}.weight") for name in configs if f"{stock_prefix}{name}.weight" in state_dict}
    if not entries:
        return
    where = f"{type(module).__name__} at '{prefix}'"
    if any(k.startswith(prefix + "collection.") for k in state_dict):
        error_msgs.append(
            f"{where}: the state_dict holds both TorchRec's '{attr}.<table>.weight' entries and dynemb's 'collection.*' entries; "
            "load one of the two formats (the module was not changed)"
        )
        _keep_collection(module, state_dict, prefix)
        return
    missing_keys.extend(f"{stock_prefix}{name}.weight" for name in configs if name not in entries)
    errors = []
    for name, value in entries.items():
        shape = (configs[name].num_embeddings, configs[name].embedding_dim)
        if not isinstance(value, torch.Tensor) or value.is_meta or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            errors.append(f"{where}: size mismatch for {stock_prefix}{name}.weight: got {got}, the table's TorchRec config has {shape}")
            continue
        if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
            errors.append(f"{where}: {stock_prefix}{name}.weight must hold finite floats (dtype {value.dtype})")
            continue
        try:
            _check_capacity(module.collection, name, shape[0])
        except ValueError as e:
            errors.append(f"{where}: {e}")
    if errors:
        error_msgs.extend(e + " (the module was not changed)" for e in errors)
    else:
        try:
            for name, value in entries.items():
                _replace_with_stock_rows(module.collection, name, value)
        except ValueError as e:
            error_msgs.append(f"{where}: {e}")
    _keep_collection(module, state_dict, prefix)


def _dynemb_tables(module: torch.nn.Module) -> DynamicTables:
    """The dynemb tables behind a drop-in EBC / EC, a native collection or a DynamicTable."""
    if isinstance(module, DynamicTables):
        return module
    collection = getattr(module, "collection", None)
    if isinstance(module, (torchrec.EmbeddingBagCollection, torchrec.EmbeddingCollection)) and isinstance(collection, DynamicTables):
        return collection
    raise TypeError(
        f"module={type(module).__name__}: expected a dynemb.torchrec EmbeddingBagCollection / EmbeddingCollection, "
        "a dynemb collection or a dynemb.DynamicTable (a stock TorchRec module holds its weight already)"
    )


def to_stock_weight(module: torch.nn.Module, table: str | None, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One dynemb table as a stock TorchRec weight for a key -> id map.

    Args:
        module: a ``dynemb.torchrec`` EBC / EC, a dynemb collection, or a ``DynamicTable``.
        table: the table's name (``None`` for a ``DynamicTable``).
        keys (Tensor[int64]): [K] the map: ``keys[i]`` is the key whose row becomes row (id) i.
            ``torch.arange(num_embeddings)`` undoes ``convert()``.
    Returns:
        weight (Tensor): [K, D] in the table's dtype and device; row i is the embedding of
            ``keys[i]``, or the table's ``eval_default`` (0 unless configured: what the dynemb
            module gives that key in eval mode) when the table does not hold it.
        found (Tensor[bool]): [K] whether the table holds ``keys[i]``.

    No side effects (no insert, no score change): it is the table's ``find``.
    """
    tables = _dynemb_tables(module)
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
        got = f"{keys.dtype} of shape {tuple(keys.shape)}" if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise ValueError(f"keys: must be a 1-D int64 tensor (keys[i] becomes row i), got {got}")
    if isinstance(tables, DynamicTable):
        if table is not None and table != tables.table_names[0]:
            raise KeyError(f"table={table!r}: this DynamicTable is {tables.table_names[0]!r}; pass None or its name")
        return tables.find(keys)
    return tables.find(table, keys)


def to_stock_state_dict(module: torch.nn.Module, keys: Mapping[str, torch.Tensor] | None = None, prefix: str = "") -> dict[str, torch.Tensor]:
    """A drop-in EBC / EC as the ``state_dict`` of the stock TorchRec module of the same configs.

    Args:
        module: a ``dynemb.torchrec`` EmbeddingBagCollection or EmbeddingCollection.
        keys: table name -> [N] int64 key -> id map (see :func:`to_stock_weight`); tables it
            leaves out use ``torch.arange(num_embeddings)``, the inverse of ``convert()``.
        prefix: put before every entry (the module's path in a bigger model, with its dot).
    Returns:
        ``{prefix + "embedding_bags.<table>.weight": [N, D]}`` (EBC) or ``"embeddings..."`` (EC),
        rows of keys the table does not hold being its ``eval_default``. A stock module loads it
        when each ``N`` is its table's ``num_embeddings``.
    """
    tables = _dynemb_tables(module)
    attr, configs = _layout(module)
    keys = dict(keys or {})
    unknown = [name for name in keys if name not in configs]
    if unknown:
        raise ValueError(f"keys names table(s) {unknown} that are not among the tables {list(configs)}")
    out = {}
    for name, config in configs.items():
        device = tables.table_configs[tables.table_names.index(name)].device
        ids = keys[name] if name in keys else torch.arange(config.num_embeddings, dtype=torch.int64, device=device)
        out[f"{prefix}{attr}.{name}.weight"] = to_stock_weight(tables, name, ids)[0]
    return out
