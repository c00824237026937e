"""Input dists of dynemb's row-wise shardings: which rank each raw int64 key goes to."""

from __future__ import annotations

import torch
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding, RwSparseFeaturesDist
from torchrec.distributed.types import ShardingType

from dynemb.torchrec.kernel import PooledLookup, SequenceLookup


def _raw_key_dist(
    pg, world_size: int, num_features: int, device: torch.device, has_feature_processor: bool, is_sequence: bool, need_pos: bool
) -> RwSparseFeaturesDist:
    """TorchRec's row-wise input dist with a hash size of W per feature (block size 1) and the
    ids kept: id -> rank ``uint64(id) % W``, unchanged. The arguments are the sharding's own
    (its process group, W, feature count, device), which only the sharding subclasses can read."""
    return RwSparseFeaturesDist(
        pg=pg,
        num_features=num_features,
        feature_hash_sizes=[world_size] * num_features,
        device=device,
        is_sequence=is_sequence,
        has_feature_processor=has_feature_processor,
        need_pos=need_pos,
        keep_original_indices=True,
    )


class RowWisePooledSharding(RwPooledEmbeddingSharding):
    def create_input_dist(self, device: torch.device | None = None) -> RwSparseFeaturesDist:
        device = device if device is not None else self._device
        return _raw_key_dist(
            self._pg, self._world_size, len(self.feature_names()), device, self._has_feature_processor, is_sequence=False, need_pos=self._need_pos
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
    def create_input_dist(self, device: torch.device | None = None) -> RwSparseFeaturesDist:
        device = device if device is not None else self._device
        return _raw_key_dist(self._pg, self._world_size, len(self.feature_names()), device, self._has_feature_processor, is_sequence=True, need_pos=False)

    def create_lookup(self, device: torch.device | None = None, fused_params: dict | None = None, feature_processor=None) -> SequenceLookup:
        return SequenceLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._pg, device=device if device is not None else self._device, env=self._env
        )
