"""convert(): swap TorchRec's EmbeddingBagCollection / EmbeddingCollection for dynemb's, in place."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torchrec

from dynemb.torchrec.configs import check_options
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection


def _device(module: torch.nn.Module) -> torch.device | None:
    device = getattr(module, "device", None)
    return None if device is None or torch.device(device).type == "meta" else torch.device(device)


def _replacement(module: torch.nn.Module, options: dict, optimizer, update: str) -> torch.nn.Module | None:
    # Exact classes: subclasses (ours included, or a user's own) are left alone.
    if type(module) is torchrec.EmbeddingBagCollection:
        tables = module.embedding_bag_configs()
        opts = {t.name: options[t.name] for t in tables if t.name in options}
        return EmbeddingBagCollection(tables, options=opts, optimizer=optimizer, update=update, device=_device(module), is_weighted=module.is_weighted())
    if type(module) is torchrec.EmbeddingCollection:
        tables = module.embedding_configs()
        opts = {t.name: options[t.name] for t in tables if t.name in options}
        return EmbeddingCollection(tables, options=opts, optimizer=optimizer, update=update, device=_device(module), need_indices=module.need_indices())
    return None


def convert(
    model: torch.nn.Module,
    options: Mapping[str, Mapping] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    update: str = "fused",
) -> torch.nn.Module:
    """Replace every ``torchrec.EmbeddingBagCollection`` / ``torchrec.EmbeddingCollection`` in
    ``model`` with :class:`dynemb.torchrec.EmbeddingBagCollection` / ``EmbeddingCollection``.

    Args:
        model: any module; the swap happens in place (a module used in several places is
            replaced by one dynemb module everywhere).
        options: table name -> extra ``dynemb.TableConfig`` fields, for tables of any of the
            collections; a name that matches no table raises ValueError.
        optimizer: the fused dynemb optimizer of every converted table (``None``: frozen).
        update: ``"fused"`` or ``"deferred"``.
    Returns:
        ``model`` (or the new module when ``model`` itself is a TorchRec collection).

    The new modules keep the TorchRec configs (same objects), so feature order and names stay;
    the old dense weights are not copied: dynemb tables start empty and fill by key.
    """
    modules = [m for m in model.modules() if type(m) in (torchrec.EmbeddingBagCollection, torchrec.EmbeddingCollection)]
    table_names = [t.name for m in modules for t in (m.embedding_bag_configs() if isinstance(m, torchrec.EmbeddingBagCollection) else m.embedding_configs())]
    opts = check_options(options, table_names)
    swapped: dict[int, torch.nn.Module] = {}
    for m in modules:
        if id(m) not in swapped:
            swapped[id(m)] = _replacement(m, opts, optimizer, update)
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
