"""Drop-in TorchRec EmbeddingBagCollection / EmbeddingCollection backed by dynemb tables.

B samples (the KJT's stride), n_f ids of feature f, D_f its dim, F features.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torchrec
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from torchrec.sparse.tensor_dict import maybe_td_to_kjt

from dynemb.nn import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
from dynemb.nn.tables import DynamicTables
from dynemb.torchrec.configs import check_options, table_config
from dynemb.torchrec.lifecycle import TorchRecTables, is_meta, unbuilt_error
from dynemb.torchrec.optimizers import UNSET
from dynemb.torchrec.stock import load_stock_entries

_META = torch.device("meta")


def _strip_dummy_weights(tables: torch.nn.ModuleDict, device: torch.device) -> None:
    """Turn TorchRec's per-table weights (meta, shape [num_embeddings, D]) into plain attributes
    on ``device`` that take no memory (meta, or one zero expanded to the shape: stride 0).

    The modules stay, so TorchRec code that reads ``embedding_bags[name].weight.shape`` /
    ``.device`` or the module's ``num_embeddings`` still works, but the weights are no longer
    parameters: they are not in ``parameters()`` or ``state_dict()``, and ``.to()`` / ``.cuda()``
    skip them (the module's ``_apply`` sets them again on the tables' device).
    """
    for module in tables.values():
        weight = module.weight.detach()
        del module.weight
        module.weight = weight if device.type == "meta" else torch.zeros((), dtype=weight.dtype, device=device).expand(weight.shape)


def _without_weights(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The KJT without its weights (TorchRec's unweighted modules ignore them; dynemb's reject them)."""
    if features.weights_or_none() is None:
        return features
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        lengths=features.lengths_or_none(),
        offsets=features.offsets_or_none(),
        stride=features.stride(),
    )


def _reject_variable_batch(features: KeyedJaggedTensor, owner: str) -> None:
    if features.variable_stride_per_key() or features.inverse_indices_or_none() is not None:
        raise ValueError(
            f"{owner}: variable-batch KeyedJaggedTensor (stride_per_key_per_rank / inverse_indices, TorchRec's VBE) "
            "is not supported; pass a KeyedJaggedTensor with one stride for every feature"
        )


def _embedding_pairs(feature_names: list[list[str]], embedding_names: list[list[str]]) -> tuple[tuple[str, str], ...]:
    """(embedding name, feature name) of every lookup, tables in order: the names the native
    collection knows each lookup by (the feature, or ``feature@table`` when several tables share it)."""
    return tuple((e, f) for es, fs in zip(embedding_names, feature_names) for e, f in zip(es, fs))


def _check_keys(keys: list[str], pairs: tuple[tuple[str, str], ...]) -> None:
    known = {f for _, f in pairs}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}: this collection looks up {sorted(known)}")
    missing = known.difference(keys)
    if missing:
        raise ValueError(f"missing feature(s) {sorted(missing)} in the KeyedJaggedTensor")


def _renamed(features: KeyedJaggedTensor, pairs: tuple[tuple[str, str], ...], weighted: bool) -> KeyedJaggedTensor:
    """The KJT the native collection reads. Only when a feature is shared (an embedding name
    differs from its feature) is a new KJT built, listing the shared feature's ids once per table;
    otherwise the input passes through (the native collection checks its keys)."""
    if all(e == f for e, f in pairs):
        return features
    _check_keys(features.keys(), pairs)
    jts = features.to_dict()
    return KeyedJaggedTensor.from_jt_dict(
        {e: JaggedTensor(values=jts[f].values(), lengths=jts[f].lengths(), weights=jts[f].weights_or_none() if weighted else None) for e, f in pairs}
    )


def _check_built(collection: DynamicTables | None, owner: str) -> None:
    if collection is None:
        raise unbuilt_error(owner)


# The lookups are fx leaves (torch.fx.wrap): torchrec.fx.symbolic_trace records one call per
# forward, with the native collection as a get_attr argument, instead of tracing into the
# collection's data-dependent code (dedup, hash probes, checks). TorchRec's pipelines and
# inference tooling then walk the model as they walk TorchRec's own modules.
@torch.fx.wrap
def _pooled_lookup(
    collection: DynamicEmbeddingBagCollection | None,
    features: KeyedJaggedTensor,
    pairs: tuple[tuple[str, str], ...],
    dims: tuple[int, ...],
    weighted: bool,
    owner: str,
) -> torch.Tensor:
    """features: KJT (or TensorDict) of F features x B samples -> [B, sum D_f] float32, the
    lookups in ``pairs`` order, ``dims`` their D_f."""
    features = maybe_td_to_kjt(features, None)
    _reject_variable_batch(features, owner)
    if not pairs:
        # TorchRec's EmbeddingBagCollection(tables=[]) fails here too (torch.cat of no embeddings).
        raise ValueError(f"{owner} has no tables (tables=[]): there are no embeddings to pool")
    if features.values().is_meta:
        # Shapes only, as TorchRec's modules give for meta inputs: no table is read.
        _check_keys(features.keys(), pairs)
        return torch.empty(features.stride(), sum(dims), device=features.values().device)  # [B, sum D_f]
    _check_built(collection, owner)
    if not weighted:
        features = _without_weights(features)
    return collection(_renamed(features, pairs, weighted)).concat.float()  # [B, sum D_f]


@torch.fx.wrap
def _sequence_lookup(
    collection: DynamicEmbeddingCollection | None,
    features: KeyedJaggedTensor,
    pairs: tuple[tuple[str, str], ...],
    dim: int,
    need_indices: bool,
    owner: str,
) -> dict[str, JaggedTensor]:
    """features: KJT (or TensorDict) of F features x B samples -> embedding name -> JaggedTensor
    (values [n_f, D] float32, the feature's lengths [B], its ids as weights if ``need_indices``)."""
    features = maybe_td_to_kjt(features, None)
    _reject_variable_batch(features, owner)
    if not pairs:
        if features.keys():
            raise ValueError(f"unknown feature(s) {features.keys()}: this {owner} has no tables (tables=[])")
        return {}
    meta = features.values().is_meta
    jts = features.to_dict() if meta or need_indices else {}
    if meta:
        # Shapes only, as TorchRec's modules give for meta inputs: no table is read.
        _check_keys(features.keys(), pairs)
        out = {e: (torch.empty(jts[f].values().numel(), dim, device=features.values().device), jts[f].lengths()) for e, f in pairs}
    else:
        _check_built(collection, owner)
        out = collection(_renamed(_without_weights(features), pairs, weighted=False))
    result: dict[str, JaggedTensor] = {}
    for embedding_name, feature_name in pairs:
        values, lengths = out[embedding_name]
        result[embedding_name] = JaggedTensor(
            values=values.float(),  # [n_f, D]
            lengths=lengths,
            weights=jts[feature_name].values() if need_indices else None,
        )
    return result


class EmbeddingBagCollection(TorchRecTables, torchrec.EmbeddingBagCollection):
    """TorchRec's ``EmbeddingBagCollection`` whose tables are dynemb tables keyed by raw int64 ids.

    Args:
        tables: TorchRec ``EmbeddingBagConfig`` s (name, feature_names, embedding_dim, pooling
            SUM or MEAN, data_type FP32, BF16 or FP16). ``num_embeddings`` becomes the table's
            ``capacity`` (most keys held), not a bound on the ids: every int64 is a valid id.
        options: table name -> extra ``dynemb.TableConfig`` fields (``capacity``,
            ``score_strategy``, ``initializer``, ``admission``, ``device``...).
        optimizer: fused dynemb optimizer (``dynemb.optim.*``) for every table; ``None``: frozen
            on purpose. Not passed: ``apply_optimizer_in_backward`` on ``module.parameters()``,
            or a sharder's ``fused_params``, chooses it; with neither, TorchRec's fused default
            (SGD, lr 0.01) with a warning (docs/design/0027-torchrec-optimizers.md).
        update: ``"fused"`` (rows updated in backward) or ``"deferred"`` (on ``optimizer.step()``).
        device: where the tables live (default CPU) unless ``options`` says otherwise;
            ``"meta"`` (or a ``with torch.device("meta")`` block) builds no table: DMP creates
            them on each rank, ``module.to_empty(device=...)`` for unsharded use.
        is_weighted: as TorchRec's: pool with the KJT's weights.

    ``forward(features: KeyedJaggedTensor) -> KeyedTensor`` exactly as TorchRec's: keys are the
    embedding names in table order, values ``[B, sum D_f]``, ``length_per_key`` the dims. The
    native collection is ``self.collection`` (a ``dynemb.DynamicEmbeddingBagCollection``, ``None``
    for ``tables=[]``); the module's ``state_dict()`` holds its tables and no dense
    ``[num_embeddings, D]`` weight. The lookup is one leaf for ``torchrec.fx.symbolic_trace``.
    """

    def __init__(
        self,
        tables: list[torchrec.EmbeddingBagConfig],
        *,
        options: Mapping[str, Mapping] | None = None,
        optimizer: torch.optim.Optimizer | None = UNSET,
        update: str = "fused",
        device: torch.device | str | None = None,
        is_weighted: bool = False,
    ):
        requested, deferred = device, is_meta(device)
        device = None if deferred else device
        # Meta dummies: TorchRec's bookkeeping (configs, names, dims) without dense weights.
        super().__init__(tables=tables, is_weighted=is_weighted, device=_META)
        _strip_dummy_weights(self.embedding_bags, _META if deferred else torch.device(device or "cpu"))
        # A stock module's state_dict (its dense weights) loads too: docs/design/0028.
        self.register_load_state_dict_pre_hook(load_stock_entries)
        names = get_embedding_names_by_table(tables)
        opts = check_options(options, [t.name for t in tables])
        configs = [table_config(t, n, opts.get(t.name, {}), device) for t, n in zip(tables, names)]
        self.setup_tables(configs, optimizer, update, deferred)
        self._device = _META if deferred and configs else configs[0].device if configs else torch.device(requested if requested is not None else "cpu")
        self._pairs = _embedding_pairs(self._feature_names, names)

    def new_collection(self, configs, optimizer) -> DynamicEmbeddingBagCollection:
        collection = DynamicEmbeddingBagCollection(configs, optimizer, update=self.update_mode, is_weighted=self._is_weighted)
        if list(collection.feature_names) != self._embedding_names:
            raise RuntimeError(f"dynemb collection orders features {list(collection.feature_names)}, TorchRec {self._embedding_names}")
        return collection

    def reset_parameters(self) -> None:
        """No-op: dynemb initialises each key's row when the key first arrives."""

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """features: KJT of F features x B samples (raw int64 ids) -> KeyedTensor [B, sum D_f]."""
        collection = self.forward_collection()
        pooled = _pooled_lookup(collection, features, self._pairs, tuple(self._lengths_per_embedding), self._is_weighted, type(self).__name__)
        return KeyedTensor(
            keys=self._embedding_names,
            values=pooled,  # [B, sum D_f]
            length_per_key=self._lengths_per_embedding,
        )

    def stats(self) -> dict[str, dict]:
        """Table name -> the table's stats (size, capacity, evictions, failed inserts...)."""
        return self.collection.stats() if self.dynemb_configs else {}

    def _apply(self, fn, recurse=True):
        # A meta module builds its tables where fn moves tensors (to_empty, .to(device)).
        if self.move_tables(fn):
            super()._apply(fn, recurse)
            # TorchRec's device() says where the tables are: it follows a move of the collection
            # (with tables=[] it stays the constructor's, as TorchRec's does).
            if self.is_built():
                self._device = self.collection.table_configs[0].device
                _strip_dummy_weights(self.embedding_bags, self._device)
        return self


class EmbeddingCollection(TorchRecTables, torchrec.EmbeddingCollection):
    """TorchRec's ``EmbeddingCollection`` whose tables are dynemb tables keyed by raw int64 ids.

    Args:
        tables: TorchRec ``EmbeddingConfig`` s (one embedding_dim for all, as TorchRec requires).
        options, optimizer, update, device: as :class:`EmbeddingBagCollection`.
        need_indices: as TorchRec's: each output JaggedTensor carries the ids as its weights.

    ``forward(features: KeyedJaggedTensor) -> dict[str, JaggedTensor]`` exactly as TorchRec's:
    embedding name -> JaggedTensor(values ``[n_f, D]``, the feature's lengths ``[B]``).
    """

    def __init__(
        self,
        tables: list[torchrec.EmbeddingConfig],
        *,
        options: Mapping[str, Mapping] | None = None,
        optimizer: torch.optim.Optimizer | None = UNSET,
        update: str = "fused",
        device: torch.device | str | None = None,
        need_indices: bool = False,
    ):
        requested, deferred = device, is_meta(device)
        device = None if deferred else device
        super().__init__(tables=tables, device=_META, need_indices=need_indices)
        _strip_dummy_weights(self.embeddings, _META if deferred else torch.device(device or "cpu"))
        # A stock module's state_dict (its dense weights) loads too: docs/design/0028.
        self.register_load_state_dict_pre_hook(load_stock_entries)
        opts = check_options(options, [t.name for t in tables])
        names = self._embedding_names_by_table
        configs = [table_config(t, n, opts.get(t.name, {}), device) for t, n in zip(tables, names)]
        self.setup_tables(configs, optimizer, update, deferred)
        self._device = _META if deferred and configs else configs[0].device if configs else torch.device(requested if requested is not None else "cpu")
        self._pairs = _embedding_pairs(self._feature_names, names)

    def new_collection(self, configs, optimizer) -> DynamicEmbeddingCollection:
        collection = DynamicEmbeddingCollection(configs, optimizer, update=self.update_mode)
        flat = [n for ns in self._embedding_names_by_table for n in ns]
        if list(collection.feature_names) != flat:
            raise RuntimeError(f"dynemb collection orders features {list(collection.feature_names)}, TorchRec {flat}")
        return collection

    def reset_parameters(self) -> None:
        """No-op: dynemb initialises each key's row when the key first arrives."""

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """features: KJT of F features x B samples (raw int64 ids) -> name -> JaggedTensor [n_f, D]."""
        collection = self.forward_collection()
        return _sequence_lookup(collection, features, self._pairs, self.embedding_dim(), self._need_indices, type(self).__name__)

    def stats(self) -> dict[str, dict]:
        """Table name -> the table's stats (size, capacity, evictions, failed inserts...)."""
        return self.collection.stats() if self.dynemb_configs else {}

    def _apply(self, fn, recurse=True):
        # A meta module builds its tables where fn moves tensors (to_empty, .to(device)).
        if self.move_tables(fn):
            super()._apply(fn, recurse)
            # TorchRec's device() says where the tables are: it follows a move of the collection
            # (with tables=[] it stays the constructor's, as TorchRec's does).
            if self.is_built():
                self._device = self.collection.table_configs[0].device
                _strip_dummy_weights(self.embeddings, self._device)
        return self
