"""TorchRec table configs -> dynemb.TableConfig.

One TorchRec ``EmbeddingBagConfig`` / ``EmbeddingConfig`` becomes one ``dynemb.TableConfig``:
name, feature names and dim are TorchRec's, ``capacity`` defaults to ``num_embeddings``, and any
other TableConfig field may be given per table in ``options[table_name]``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping, Sequence

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType, EmbeddingBagConfig, PoolingType

import dynemb

# Fields that come from the TorchRec config itself; options may not override them.
_FROM_TORCHREC = ("name", "feature_names", "embedding_dim", "pooling")
_DTYPES = {DataType.FP32: torch.float32, DataType.BF16: torch.bfloat16, DataType.FP16: torch.float16}
_POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


def check_options(options: Mapping[str, Mapping] | None, table_names: Sequence[str]) -> dict[str, dict]:
    """Validate ``options`` (table name -> TableConfig fields) against the tables present."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict of table name -> dict of dynemb.TableConfig fields, got {type(options).__name__}")
    unknown = [name for name in options if name not in table_names]
    if unknown:
        raise ValueError(f"options name table(s) {unknown} that are not among the tables {list(table_names)}")
    fields = {f.name for f in dataclasses.fields(dynemb.TableConfig)}
    for table, opts in options.items():
        if not isinstance(opts, Mapping):
            raise TypeError(f"options[{table!r}] must be a dict of dynemb.TableConfig fields, got {type(opts).__name__}")
        for key in opts:
            if key in _FROM_TORCHREC:
                raise ValueError(f"options[{table!r}][{key!r}]: {key} comes from the TorchRec config and cannot be overridden")
            if key not in fields:
                raise ValueError(f"options[{table!r}][{key!r}]: not a dynemb.TableConfig field (one of {sorted(fields - set(_FROM_TORCHREC))})")
    return {table: dict(opts) for table, opts in options.items()}


def _is_torchrec_default_init(cfg: BaseEmbeddingConfig) -> bool:
    """TorchRec's __post_init__ sets init_fn = uniform_(weight_init_min, weight_init_max)."""
    fn = cfg.init_fn
    return fn is None or (
        isinstance(fn, functools.partial)
        and fn.func is torch.nn.init.uniform_
        and fn.keywords == {"a": cfg.get_weight_init_min(), "b": cfg.get_weight_init_max()}
    )


def table_config(
    cfg: BaseEmbeddingConfig,
    embedding_name_features: Sequence[str],
    options: Mapping[str, object],
    device: torch.device | str | None,
) -> dynemb.TableConfig:
    """The dynemb.TableConfig of one TorchRec table config.

    Args:
        cfg: TorchRec ``EmbeddingBagConfig`` (pooled) or ``EmbeddingConfig`` (sequence).
        embedding_name_features: the names the native collection looks this table's features
            up by (TorchRec's embedding names: ``feature``, or ``feature@table`` when several
            tables share the feature).
        options: this table's extra TableConfig fields.
        device: where the table lives unless ``options`` says otherwise (default CPU).
    """
    fields: dict[str, object] = {
        "name": cfg.name,
        "feature_names": list(embedding_name_features),
        "embedding_dim": cfg.embedding_dim,
        "capacity": cfg.num_embeddings,
        "device": device if device is not None else "cpu",
    }
    if isinstance(cfg, EmbeddingBagConfig):
        if cfg.pooling not in _POOLING:
            raise ValueError(f"table {cfg.name!r}: pooling={cfg.pooling}: dynemb bags pool with PoolingType.SUM or PoolingType.MEAN")
        fields["pooling"] = _POOLING[cfg.pooling]
    if "dtype" not in options:
        if cfg.data_type not in _DTYPES:
            raise ValueError(
                f"table {cfg.name!r}: data_type={cfg.data_type}: dynemb tables hold float32, float64, bfloat16 or float16; "
                f"use DataType.FP32 or pass options={{{cfg.name!r}: {{'dtype': torch.float32}}}}"
            )
        fields["dtype"] = _DTYPES[cfg.data_type]
    if "initializer" not in options:
        if cfg.weight_init_min is not None or cfg.weight_init_max is not None:
            # Explicit bounds are honoured; TorchRec's default (+-sqrt(1/num_embeddings)) is not:
            # num_embeddings is only a capacity here, so dynemb's default (+-1/sqrt(D)) applies.
            fields["initializer"] = dynemb.Initializer(kind="uniform", low=cfg.get_weight_init_min(), high=cfg.get_weight_init_max())
        elif not _is_torchrec_default_init(cfg):
            warnings.warn(
                f"table {cfg.name!r}: init_fn={cfg.init_fn!r} is not applied (dynemb initialises each new key's row itself); "
                f"pass options={{{cfg.name!r}: {{'initializer': dynemb.Initializer(...)}}}} to choose it",
                UserWarning,
                stacklevel=4,
            )
    fields.update(options)
    try:
        return dynemb.TableConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"table {cfg.name!r}: {e}") from None
