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
from dynemb.torchrec.configs import check_options, table_config
from dynemb.torchrec.lifecycle import TorchRecTables, is_meta
from dynemb.torchrec.optimizers import UNSET
from dynemb.torchrec.stock import load_stock_entries

_META = torch.device("meta")


def _strip_dummy_weights(tables: torch.nn.ModuleDict) -> None:
    """Turn TorchRec's per-table weights (meta, shape [num_embeddings, D]) into plain attributes.

    The modules stay, so TorchRec code that reads ``embedding_bags[name].weight.shape`` or the
    module's ``num_embeddings`` still works, but the weights are no longer parameters: they are
    not in ``parameters()`` or ``state_dict()``, and ``.to()`` / ``.cuda()`` (which cannot copy a
    meta tensor) skip them.
    """
    for module in tables.values():
        weight = module.weight.detach()
        del module.weight
        module.weight = weight


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


class _Features:
    """Maps the KJT a TorchRec module receives to the one its native collection reads.

    The native collection knows each lookup by TorchRec's embedding name: the feature name, or
    ``feature@table`` when several tables share a feature. Only in that case is a new KJT built
    (the shared feature's ids listed once per table); otherwise the input passes through.
    """

    def __init__(self, feature_names: list[list[str]], embedding_names: list[list[str]]):
        self.pairs = [(e, f) for es, fs in zip(embedding_names, feature_names) for e, f in zip(es, fs)]
        self.renamed = any(e != f for e, f in self.pairs)
        self.known = {f for _, f in self.pairs}

    def __call__(self, features: KeyedJaggedTensor, weighted: bool) -> KeyedJaggedTensor:
        if not self.renamed:
            return features
        unknown = [k for k in features.keys() if k not in self.known]
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}: this collection looks up {sorted(self.known)}")
        jts = features.to_dict()
        missing = [f for f in self.known if f not in jts]
        if missing:
            raise ValueError(f"missing feature(s) {sorted(missing)} in the KeyedJaggedTensor")
        return KeyedJaggedTensor.from_jt_dict(
            {e: JaggedTensor(values=jts[f].values(), lengths=jts[f].lengths(), weights=jts[f].weights_or_none() if weighted else None) for e, f in self.pairs}
        )


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
    native collection is ``self.collection`` (a ``dynemb.DynamicEmbeddingBagCollection``); the
    module's ``state_dict()`` holds its tables and no dense ``[num_embeddings, D]`` weight.
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
        deferred = is_meta(device)
        device = None if deferred else device
        # Meta dummies: TorchRec's bookkeeping (configs, names, dims) without dense weights.
        super().__init__(tables=tables, is_weighted=is_weighted, device=_META)
        _strip_dummy_weights(self.embedding_bags)
        # A stock module's state_dict (its dense weights) loads too: docs/design/0028.
        self.register_load_state_dict_pre_hook(load_stock_entries)
        names = get_embedding_names_by_table(tables)
        opts = check_options(options, [t.name for t in tables])
        configs = [table_config(t, n, opts.get(t.name, {}), device) for t, n in zip(tables, names)]
        self.setup_tables(configs, optimizer, update, deferred)
        self._device = _META if deferred else configs[0].device if configs else torch.device(device or "cpu")
        self._features = _Features(self._feature_names, names)

    def new_collection(self, configs, optimizer) -> DynamicEmbeddingBagCollection:
        collection = DynamicEmbeddingBagCollection(configs, optimizer, update=self.update_mode, is_weighted=self._is_weighted)
        if list(collection.feature_names) != self._embedding_names:
            raise RuntimeError(f"dynemb collection orders features {list(collection.feature_names)}, TorchRec {self._embedding_names}")
        return collection

    def reset_parameters(self) -> None:
        """No-op: dynemb initialises each key's row when the key first arrives."""

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """features: KJT of F features x B samples (raw int64 ids) -> KeyedTensor [B, sum D_f]."""
        features = maybe_td_to_kjt(features, None)
        _reject_variable_batch(features, type(self).__name__)
        if not self._is_weighted:
            features = _without_weights(features)
        if self.training and torch.is_grad_enabled():
            self.settle_optimizer()
        pooled = self.collection(self._features(features, self._is_weighted))
        return KeyedTensor(
            keys=self._embedding_names,
            values=pooled.concat.float(),  # [B, sum D_f]
            length_per_key=self._lengths_per_embedding,
        )

    def stats(self) -> dict[str, dict]:
        """Table name -> the table's stats (size, capacity, evictions, failed inserts...)."""
        return self.collection.stats()

    def _apply(self, fn, recurse=True):
        # A meta module builds its tables where fn moves tensors (to_empty, .to(device)).
        if self.move_tables(fn):
            super()._apply(fn, recurse)
            # TorchRec's device() says where the tables are: it follows a move of the collection.
            configs = self.collection.table_configs
            self._device = configs[0].device if configs else self._device
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
        deferred = is_meta(device)
        device = None if deferred else device
        super().__init__(tables=tables, device=_META, need_indices=need_indices)
        _strip_dummy_weights(self.embeddings)
        # A stock module's state_dict (its dense weights) loads too: docs/design/0028.
        self.register_load_state_dict_pre_hook(load_stock_entries)
        opts = check_options(options, [t.name for t in tables])
        names = self._embedding_names_by_table
        configs = [table_config(t, n, opts.get(t.name, {}), device) for t, n in zip(tables, names)]
        self.setup_tables(configs, optimizer, update, deferred)
        self._device = _META if deferred else configs[0].device if configs else torch.device(device or "cpu")
        self._features = _Features(self._feature_names, names)

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
        features = maybe_td_to_kjt(features, None)
        _reject_variable_batch(features, type(self).__name__)
        if self.training and torch.is_grad_enabled():
            self.settle_optimizer()
        out = self.collection(self._features(_without_weights(features), weighted=False))
        result: dict[str, JaggedTensor] = {}
        for embedding_name, feature_name in self._features.pairs:
            values, lengths = out[embedding_name]
            result[embedding_name] = JaggedTensor(
                values=values.float(),  # [n_f, D]
                lengths=lengths,
                weights=features[feature_name].values() if self._need_indices else None,
            )
        return result

    def stats(self) -> dict[str, dict]:
        """Table name -> the table's stats (size, capacity, evictions, failed inserts...)."""
        return self.collection.stats()

    def _apply(self, fn, recurse=True):
        # A meta module builds its tables where fn moves tensors (to_empty, .to(device)).
        if self.move_tables(fn):
            super()._apply(fn, recurse)
            # TorchRec's device() says where the tables are: it follows a move of the collection.
            configs = self.collection.table_configs
            self._device = configs[0].device if configs else self._device
        return self
