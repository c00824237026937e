"""convert(): swap TorchRec's EmbeddingBagCollection / EmbeddingCollection for dynemb's, in place,
with their trained rows (docs/design/0012-torchrec.md, 0028-torchrec-stock-rows.md)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torchrec

from dynemb.torchrec.configs import check_options
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection
from dynemb.torchrec.optimizers import UNSET
from dynemb.torchrec.stock import copy_stock_rows, stock_capacity, stock_weights


def _device(module: torch.nn.Module) -> torch.device | None:
    """The stock module's device; a meta module becomes a meta dynemb module (tables deferred)."""
    device = getattr(module, "device", None)
    return None if device is None else torch.device(device)


def _replacement(module: torch.nn.Module, options: dict, optimizer, update: str, copy_rows: bool) -> torch.nn.Module | None:
    # Exact classes: subclasses (ours included, or a user's own) are left alone.
    if type(module) is torchrec.EmbeddingBagCollection:
        tables = module.embedding_bag_configs()
    elif type(module) is torchrec.EmbeddingCollection:
        tables = module.embedding_configs()
    else:
        return None
    weights = stock_weights(module) if copy_rows else {}
    opts = {t.name: options[t.name] for t in tables if t.name in options}
    for t in tables:
        if t.name not in weights:
            continue
        capacity = opts.get(t.name, {}).get("capacity")
        if capacity is None:
            opts[t.name] = {**opts.get(t.name, {}), "capacity": stock_capacity(t.num_embeddings)}
        elif isinstance(capacity, int) and capacity < t.num_embeddings:
            # Before anything is built: copy_rows=True never drops a trained row.
            raise ValueError(
                f"convert(): options[{t.name!r}]['capacity']={capacity} is smaller than the table's {t.num_embeddings} rows (num_embeddings); "
                f"give a capacity >= {t.num_embeddings} or pass copy_rows=False"
            )
    if type(module) is torchrec.EmbeddingBagCollection:
        new = EmbeddingBagCollection(tables, options=opts, optimizer=optimizer, update=update, device=_device(module), is_weighted=module.is_weighted())
    else:
        new = EmbeddingCollection(tables, options=opts, optimizer=optimizer, update=update, device=_device(module), need_indices=module.need_indices())
    for name, weight in weights.items():
        copy_stock_rows(new.collection, name, weight)
    return new


def convert(
    model: torch.nn.Module,
    options: Mapping[str, Mapping] | None = None,
    optimizer: torch.optim.Optimizer | None = UNSET,
    update: str = "fused",
    *,
    copy_rows: bool = True,
) -> torch.nn.Module:
    """Replace every ``torchrec.EmbeddingBagCollection`` / ``torchrec.EmbeddingCollection`` in
    ``model`` with :class:`dynemb.torchrec.EmbeddingBagCollection` / ``EmbeddingCollection``.

    Args:
        model: any module; the swap happens in place (a module used in several places is
            replaced by one dynemb module everywhere).
        options: table name -> extra ``dynemb.TableConfig`` fields, for tables of any of the
            collections; a name that matches no table raises ValueError.
        optimizer: the fused dynemb optimizer of every converted table (``None``: frozen; not
            passed: chosen the TorchRec ways, see :class:`EmbeddingBagCollection`).
        update: ``"fused"`` or ``"deferred"``.
        copy_rows: copy each stock table's rows into its dynemb table, row i of the weight as
            key i (i < num_embeddings), so the converted model gives the stock model's outputs
            on those ids. ``False``: the tables start empty and fill by key.
    Returns:
        ``model`` (or the new module when ``model`` itself is a TorchRec collection).

    The new modules keep the TorchRec configs (same objects), so feature order and names stay.
    With ``copy_rows``, a table whose ``options`` name no capacity gets ``num_embeddings`` plus
    1/64 (a hash index cannot place every key at a load of exactly 1); a capacity below
    ``num_embeddings`` raises ValueError naming the table, as does a row that finds no slot:
    no row is dropped. The copied rows start with fresh optimizer state (a stock module keeps
    none: fused optimizers hold it elsewhere). A stock module on ``meta`` has no rows: its
    tables start empty. Anything that raises leaves ``model`` unchanged.
    """
    if not isinstance(copy_rows, bool):
        raise TypeError(f"copy_rows={copy_rows!r}: must be True or False")
    modules = [m for m in model.modules() if type(m) in (torchrec.EmbeddingBagCollection, torchrec.EmbeddingCollection)]
    table_names = [t.name for m in modules for t in (m.embedding_bag_configs() if isinstance(m, torchrec.EmbeddingBagCollection) else m.embedding_configs())]
    opts = check_options(options, table_names)
    swapped: dict[int, torch.nn.Module] = {}
    for m in modules:
        if id(m) not in swapped:
            swapped[id(m)] = _replacement(m, opts, optimizer, update, copy_rows)
    if id(model) in swapped:
        return swapped[id(model)]
    # remove_duplicate=False: a module held at two places is replaced at both. The paths are
    # listed before any swap, and those inside a replaced module are left alone.
    replaced: list[str] = []
    for path, child in list(model.named_modules(remove_duplicate=False)):
        if path and id(child) in swapped and not any(path.startswith(p + ".") for p in replaced):
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, swapped[id(child)])
            replaced.append(path)
    return model
