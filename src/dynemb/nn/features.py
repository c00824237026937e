"""The input of a collection: KeyedJaggedTensor or dict, checked and split per feature.

F features, B samples (the batch), N_f ids of feature f.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class Batch:
    """Validated input: per feature (collection order) its values [N_f], lengths [B] and weights."""

    def __init__(
        self,
        values: list[torch.Tensor],
        lengths: list[torch.Tensor],
        weights: list[torch.Tensor | None],
        batch: int,
        stacked: torch.Tensor,
        uniform_length: int | None = None,
    ):
        self.values, self.lengths, self.weights, self.batch = values, lengths, weights, batch
        self.stacked = stacked  # lengths [F, B]
        # The length every bag has, where all have the same (read with the lengths' check), else None.
        self.uniform_length = uniform_length
        # Whether every bag holds one id, unweighted (a host sync), once asked for.
        self.one_id_per_bag: bool | None = None


def parse_features(features, feature_names: list[str], device: torch.device, *, pooled: bool, weighted: bool) -> Batch:
    """Check a collection's input (a KeyedJaggedTensor, duck-typed, or a dict ``feature ->
    (values, lengths[, weights])``) and split it per feature, in ``feature_names`` order; raises
    ValueError / TypeError naming the feature. ``pooled`` / ``weighted``: the collection's kind."""
    kjt = None
    if isinstance(features, Mapping):
        per = {}
        for f, item in features.items():
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise ValueError(f"feature {f!r}: expected (values, lengths) or (values, lengths, weights), got {type(item).__name__}")
            per[f] = (item[0], item[1], item[2] if len(item) == 3 else None)
        names = list(per)
    elif all(hasattr(features, a) for a in ("keys", "values", "lengths")):
        if callable(getattr(features, "variable_stride_per_key", None)) and features.variable_stride_per_key():
            raise ValueError("a variable-batch KeyedJaggedTensor (stride per feature) is not supported: give every feature the same batch size")
        names = list(features.keys())
        values, lengths = features.values(), features.lengths()
        weights = features.weights_or_none() if hasattr(features, "weights_or_none") else None
        if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or (names and lengths.numel() % len(names)):
            raise ValueError(f"KeyedJaggedTensor: lengths of shape {tuple(lengths.shape)} do not split into {len(names)} features")
        per_feature = lengths.view(len(names), -1) if names else lengths.view(0, 0)
        # One pass for the lengths' range: where every bag has the same length (single-hot
        # features) the sums need no second pass; a negative length is caught below.
        lo, hi = _length_range(per_feature)
        totals = _feature_sums(per_feature, lo, hi)
        # Already the [F, B] lengths, their sums and range when the features come in the collection's order.
        kjt = (per_feature, totals, (lo, hi))
        if sum(totals) != values.numel():
            raise ValueError(f"KeyedJaggedTensor: lengths sum to {sum(totals)} but values has {values.numel()} entries")
        vs = torch.split(values, totals)
        ws = torch.split(weights, totals) if weights is not None else [None] * len(names)
        per = {f: (vs[j], per_feature[j], ws[j]) for j, f in enumerate(names)}
    else:
        raise TypeError(f"features: expected a KeyedJaggedTensor or a dict feature -> (values, lengths), got {type(features).__name__}")
    known = set(feature_names)
    unknown = [f for f in names if f not in known]
    if unknown:
        raise ValueError(f"features {unknown}: unknown to this collection (its features: {feature_names})")
    missing = [f for f in feature_names if f not in per]
    if missing:
        raise ValueError(f"features {missing}: missing from the input (every feature of the collection is needed)")
    out_v, out_l, out_w, batch = [], [], [], None
    for f in feature_names:
        v, ln, w = per[f]
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"feature {f!r}: values must be a 1-D int64 tensor, got {_describe(v)}")
        if not isinstance(ln, torch.Tensor) or ln.dim() != 1 or ln.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"feature {f!r}: lengths must be a 1-D int tensor, got {_describe(ln)}")
        if v.device != device or ln.device != device:
            raise ValueError(f"feature {f!r}: values on {v.device}, lengths on {ln.device}; the tables live on {device}")
        if batch is None:
            batch, first = ln.numel(), f
        elif ln.numel() != batch:
            raise ValueError(
                f"feature {f!r}: {ln.numel()} lengths, but feature {first!r} has {batch} (one length per sample; variable batch sizes are not supported)"
            )
        ln = ln if ln.dtype is torch.int64 else ln.to(torch.int64)
        if w is not None:
            if not pooled or not weighted:
                raise ValueError(f"feature {f!r}: weights given to an unweighted collection (build it with is_weighted=True)")
            if not isinstance(w, torch.Tensor) or w.shape != v.shape or not w.is_floating_point() or w.device != device:
                raise ValueError(f"feature {f!r}: weights must be a float tensor shaped like values {tuple(v.shape)} on {device}, got {_describe(w)}")
        elif pooled and weighted:
            raise ValueError(f"feature {f!r}: no weights, but the collection is weighted (is_weighted=True)")
        out_v.append(v if v.dtype is torch.int64 else v.to(torch.int64))
        out_l.append(ln)
        out_w.append(w)
    if batch:
        # Every feature's lengths at once (one reduction each instead of one per feature).
        if kjt is not None and names == list(feature_names) and kjt[0].dtype == torch.int64:
            stacked, sums, (lo, hi) = kjt  # [F, B], the rows of out_l; the values were split by these sums
        else:
            stacked, sums = torch.stack(out_l), None
            lo, hi = _length_range(stacked)
        if lo < 0:
            negative = (stacked < 0).any(1)
            raise ValueError(f"feature {feature_names[int(negative.nonzero()[0])]!r}: lengths must be >= 0")
        if sums is None:
            sums = _feature_sums(stacked, lo, hi)
        for f, total, v in zip(feature_names, sums, out_v):
            if total != v.numel():
                raise ValueError(f"feature {f!r}: lengths sum to {total} but values has {v.numel()} entries")
        uniform = lo if lo == hi else None
    else:
        stacked, uniform = torch.zeros(len(feature_names), 0, dtype=torch.int64, device=device), None
        for f, v in zip(feature_names, out_v):
            if v.numel():
                raise ValueError(f"feature {f!r}: lengths sum to 0 but values has {v.numel()} entries")
    return Batch(out_v, out_l, out_w, batch or 0, stacked, uniform)


def _length_range(lengths: torch.Tensor) -> tuple[int, int]:
    """(min, max) of int lengths [F, B] in one pass and one host sync; (0, 0) when empty."""
    if lengths.numel() == 0:
        return 0, 0
    lo, hi = torch.aminmax(lengths)
    return tuple(torch.stack((lo, hi)).tolist())


def _feature_sums(lengths: torch.Tensor, lo: int, hi: int) -> list[int]:
    """Each feature's length sum of lengths [F, B] whose range is [lo, hi]: no second pass where
    every bag has the same length."""
    return [lo * lengths.shape[1]] * lengths.shape[0] if lo == hi else lengths.sum(1).tolist()


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor on {value.device}"
    return type(value).__name__
