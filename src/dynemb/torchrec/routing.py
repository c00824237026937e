"""Input dists of dynemb's row-wise shardings: which rank each raw int64 key goes to.

W ranks, F features of the sharding, B samples (the KJT's stride), N ids, U distinct (feature, id)
pairs.

Every key goes to ``dynemb.distributed.owner_of(key, W)``, the owner function of dynemb's own
sharding (docs/design/0015): a checkpoint keyed by table and key loads into either by keeping,
on each rank, the keys that function gives it (docs/design/0030-dmp-checkpoints.md).
"""

from __future__ import annotations

import torch
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding, RwSparseFeaturesDist
from torchrec.distributed.types import Awaitable, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.distributed import owner_of
from dynemb.table.keys import unique_pairs
from dynemb.torchrec.kernel import PooledLookup, SequenceLookup


def _bags(features: KeyedJaggedTensor) -> torch.Tensor:
    """[N] the bag (feature * B + sample) of every value."""
    lengths = features.lengths()
    return torch.arange(lengths.numel(), device=lengths.device).repeat_interleave(lengths.long())


def route_pooled(features: KeyedJaggedTensor, world_size: int) -> KeyedJaggedTensor:
    """Every id (and its weight) to its owner, bags kept: the KJT of ``W * F`` keys (owner-major,
    then feature) and ``W * F * B`` bags that TorchRec's ``KJTAllToAll`` sends, ids in their
    bag's order (a stable sort by (owner, bag))."""
    F, B = len(features.keys()), features.stride()
    values, weights = features.values(), features.weights_or_none()
    slot = owner_of(values.long(), world_size) * (F * B) + _bags(features)  # [N] (owner, feature, sample)
    order = torch.sort(slot, stable=True).indices  # [N]
    lengths = torch.bincount(slot, minlength=world_size * F * B).to(features.lengths().dtype)  # [W * F * B]
    return KeyedJaggedTensor(
        keys=features.keys() * world_size,
        values=values.index_select(0, order),
        weights=None if weights is None else weights.index_select(0, order),
        lengths=lengths,
        stride=B,
    )


def route_sequence(features: KeyedJaggedTensor, world_size: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """The distinct ids of each feature to their owners: the KJT TorchRec's ``KJTAllToAll``
    sends (``W * F`` keys, owner-major; each (owner, feature)'s ids, sorted, in its first bag)
    and ``inverse`` [N]: the position of each input id's row among the rows that come back (the
    sequence output dist's ``unbucketize_permute_tensor``, which gathers them in input order and
    sums the gradients of repeated ids on the way back). Weights are not sent (sequence lookups
    ignore them)."""
    F, B = len(features.keys()), features.stride()
    values = features.values()
    group = owner_of(values.long(), world_size) * F + _bags(features) // max(B, 1)  # [N] (owner, feature)
    (groups, unique), inverse, _ = unique_pairs(group, values.long())  # [U], [U], [N]
    lengths = torch.zeros(world_size * F, B, dtype=features.lengths().dtype, device=values.device)
    if B:
        lengths[:, 0] = torch.bincount(groups, minlength=world_size * F)
    kjt = KeyedJaggedTensor(keys=features.keys() * world_size, values=unique, lengths=lengths.view(-1), stride=B)
    return kjt, inverse


class OwnerDist(RwSparseFeaturesDist):
    """TorchRec's row-wise input dist, each id sent to ``owner_of(id, W)`` with the id kept;
    sequence ids de-duplicated per feature first. The output dists stay TorchRec's: a subclass
    because TorchRec's sequence sharding reads ``unbucketize_permute_tensor`` from dists of
    this type only."""

    def __init__(self, pg, num_features: int, device: torch.device, *, is_sequence: bool, has_feature_processor: bool, need_pos: bool):
        if has_feature_processor or need_pos:
            raise ValueError("dynemb tables: position-weighted features (a feature processor, need_pos) are not supported")
        # TorchRec's bucketize settings are unused (forward routes); its KJTAllToAll is kept.
        super().__init__(pg=pg, num_features=num_features, feature_hash_sizes=[pg.size()] * num_features, device=device, is_sequence=is_sequence)

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if sparse_features.variable_stride_per_key():
            raise ValueError(
                "dynemb tables: variable-batch KeyedJaggedTensor (TorchRec's VBE, stride_per_key_per_rank) is not supported; "
                "pass a KeyedJaggedTensor with one stride for every feature"
            )
        if self._is_sequence:
            routed, self.unbucketize_permute_tensor = route_sequence(sparse_features, self._world_size)
        else:
            routed, self.unbucketize_permute_tensor = route_pooled(sparse_features, self._world_size), None
        return self._dist(routed)


class RowWisePooledSharding(RwPooledEmbeddingSharding):
    def create_input_dist(self, device: torch.device | None = None) -> OwnerDist:
        device = device if device is not None else self._device
        return OwnerDist(
            self._pg, len(self.feature_names()), device, is_sequence=False, has_feature_processor=self._has_feature_processor, need_pos=self._need_pos
        )

    def create_lookup(self, device: torch.device | None = None, fused_params: dict | None = None, feature_processor=None) -> PooledLookup:
        return PooledLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            sharding_type=ShardingType.ROW_WISE,
            env=self._env,
        )


class RowWiseSequenceSharding(RwSequenceEmbeddingSharding):
    def create_input_dist(self, device: torch.device | None = None) -> OwnerDist:
        device = device if device is not None else self._device
        return OwnerDist(self._pg, len(self.feature_names()), device, is_sequence=True, has_feature_processor=self._has_feature_processor, need_pos=False)

    def create_lookup(self, device: torch.device | None = None, fused_params: dict | None = None, feature_processor=None) -> SequenceLookup:
        return SequenceLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._pg, device=device if device is not None else self._device, env=self._env
        )
