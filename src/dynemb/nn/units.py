"""A bag collection's pooled output written straight into its concatenation.

B samples, F features, U_g unique (table, key) pairs of group g, N_g its ids, D_f feature f's
dim, u the unit width (the gcd of the dims), k_f = D_f / u, K = sum_f k_f units per sample.

The concat [B, sum D_f] is read as K unit rows per sample, [B * K, u]: row ``b * K + c_f + t``
is sub-unit t of sample b's feature f (c_f the exclusive cumsum of k). Every group's unique rows
[U_g, D_g] are copied into one unit table [sum_g U_g k_g, u] (row ``base_g + i * k_g + t`` is
sub-unit t of unique row i), and one call builds the whole concat: an ``index_select`` when
every bag holds one id and nothing is weighted, else one ``embedding_bag`` whose bags are the
(sample, feature, sub-unit) triples. No per-group output, no ``cat``.

Backward, per group: the concat gradient [B * K, u] is already in unit rows, so one
``embedding_bag`` over it, ids taken in unique-key order (the dedup's grouping) sub-unit by
sub-unit, sums each unique row's gradient [k_g * U_g, u] -> [U_g, D_g] with no per-id copy.

Used when every group shares one dtype and device and the unit is not too narrow
(:meth:`UnitLayout.of`); otherwise the collection pools group by group. See
docs/design/0017-pooled-units.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dynemb.kernels.pool import copy_bags_native, sum_bags_native, sum_bags_torch
from dynemb.kernels.update import update_rows_from_bags_native
from dynemb.workspace import Recycler

# Narrowest unit (elements) used, and most units per feature on average: narrower units make
# the index arrays longer than the per-group path's copies are expensive.
MIN_UNIT = 4
MAX_UNITS_PER_FEATURE = 4


class UnitLayout:
    """The static unit geometry of a bag collection (features in collection order)."""

    def __init__(self, feature_dims: list[int], group_features: list[list[int]], group_dims: list[int], feature_mean: list[bool]):
        self.unit = u = math.gcd(*feature_dims)
        self.k = [d // u for d in feature_dims]
        self.cols = [sum(self.k[:j]) for j in range(len(self.k))]
        self.K = sum(self.k)
        self.group_features = group_features
        self.group_k = [d // u for d in group_dims]
        self.feature_mean = feature_mean
        self._on: dict[torch.device, dict] = {}

    @staticmethod
    def of(feature_dims: list[int], group_features: list[list[int]], group_dims: list[int], feature_mean: list[bool], dtypes: set, devices: set):
        """The layout, or None where pooling group by group is the better (or only) way."""
        if len(dtypes) != 1 or len(devices) != 1 or not feature_dims:
            return None
        layout = UnitLayout(feature_dims, group_features, group_dims, feature_mean)
        if layout.unit < MIN_UNIT and len(set(feature_dims)) > 1:
            return None
        if layout.K > MAX_UNITS_PER_FEATURE * len(feature_dims):
            return None
        return layout

    def on(self, device: torch.device) -> dict:
        """Small index tensors of the layout on ``device`` (made once per device)."""
        consts = self._on.get(device)
        if consts is None:

            def t(values, dtype=torch.int64):
                return torch.tensor(values, dtype=dtype, device=device)

            consts = self._on[device] = {
                "k": t(self.k),
                "group_cols": [t([self.cols[j] for j in fs]) for fs in self.group_features],
                "group_feats": [t(fs) for fs in self.group_features],
                "group_mean": [t([self.feature_mean[j] for j in fs], torch.bool) for fs in self.group_features],
                "mean_cols": t([m for m, k in zip(self.feature_mean, self.k) for _ in range(k)], torch.bool),
                "arange": torch.arange(max(self.group_k), device=device),
            }
        return consts


class _GroupGrad:
    """What a group's backward needs: each id's first unit row in the concat [N_g] and its
    gradient scale [N_g] (weight / mean divisor) or None."""

    __slots__ = ("first_row", "scale")

    def __init__(self, first_row: torch.Tensor, scale: torch.Tensor | None):
        self.first_row, self.scale = first_row, scale


def one_id_per_bag(stacked: torch.Tensor, n_ids: int, weighted: bool, uniform_length: int | None = None) -> bool:
    """Whether every bag holds exactly one id, unweighted (lengths ``stacked`` [F, B], ``n_ids``
    ids in all): :func:`pool`'s copy path (one host sync, none when ``uniform_length``, the
    length every bag has, is known)."""
    if weighted or n_ids != stacked.numel():
        return False
    return uniform_length == 1 if uniform_length is not None else bool((stacked == 1).all())


def pool(
    layout: UnitLayout,
    stacked: torch.Tensor,
    rows: list[torch.Tensor],
    inverses: list[torch.Tensor],
    weights: list[torch.Tensor | None] | None,
    scratch: Callable[[], torch.Tensor],
    recycler: Recycler | None = None,
    native: bool = False,
    single: bool | None = None,
) -> tuple[torch.Tensor, list[_GroupGrad]]:
    """The concat [B, K * u] of every feature's pooled bags, and each group's backward info.

    Args:
        stacked: lengths [F, B] (int64), features in collection order.
        rows: per group, its unique rows' embeddings [U_g, D_g] (or any rows the inverses
            point into, such as the store's, on the copy path).
        inverses: per group, the row of ``rows`` of each id [N_g] (its features' ids
            concatenated in collection order).
        weights: per group, per-id weights [N_g], or None (unweighted collection).
        scratch: returns the scratch [sum_g U_g k_g, u] for the unit table (called only on the
            paths that build one).
        recycler: where the output's memory comes from (one id per bag), or None (fresh).
        native: one id per bag, unweighted: copy the rows with the compiled kernel
            (:func:`dynemb.kernels.pool.copy_bags_native`, CPU) instead of the unit table.
        single: :func:`one_id_per_bag` of this batch where the caller has it already, else None.
    """
    B = stacked.shape[1]
    K, u = layout.K, layout.unit
    device = stacked.device
    consts = layout.on(device)
    n_ids = sum(inv.numel() for inv in inverses)
    if single is None:
        single = one_id_per_bag(stacked, n_ids, weights is not None)
    sample_rows = torch.arange(B, device=device).mul_(K)  # [B] unit row of each sample's first unit
    grads: list[_GroupGrad] = []
    if single and native:
        # Each (feature, sample)'s row copied from the group's rows into its columns: no unit
        # table, no index arrays.
        out = torch.empty(B, K * u, dtype=rows[0].dtype, device=device) if recycler is None else recycler.get("concat", (B, K * u), rows[0].dtype, device)
        cols, sources, samples = [], [], []
        for g, (r, inv) in enumerate(zip(rows, inverses)):
            for j, f in enumerate(layout.group_features[g]):
                cols.append(layout.cols[f] * u)
                sources.append(r)
                samples.append(inv[j * B : (j + 1) * B])
            grads.append(_GroupGrad((consts["group_cols"][g][:, None] + sample_rows[None, :]).reshape(-1), None))
        copy_bags_native(out, cols, sources, samples)
        return out, grads
    table = scratch()
    base = 0
    bases = []
    for r, k in zip(rows, layout.group_k):
        n = r.shape[0] * k
        if n:
            table[base : base + n].view(r.shape).copy_(r)
        bases.append(base)
        base += n
    if single:
        idx = torch.empty(B * K, dtype=torch.int64, device=device)
        for g, (inv, k) in enumerate(zip(inverses, layout.group_k)):
            first_row = (consts["group_cols"][g][:, None] + sample_rows[None, :]).reshape(-1)  # [F_g * B] = [N_g]
            src = inv * k + bases[g]
            if k == 1:
                idx.scatter_(0, first_row, src)
            else:
                ar = consts["arange"][:k]
                idx.scatter_(0, (first_row[:, None] + ar).reshape(-1), (src[:, None] + ar).reshape(-1))
            grads.append(_GroupGrad(first_row, None))
        if recycler is None:
            return _reshaped(table.index_select(0, idx), (B, K * u)), grads
        out = recycler.get("concat", (B, K * u), table.dtype, device)
        torch.index_select(table, 0, idx, out=out.view(B * K, u))
        return out, grads
    unit_len = stacked.t().repeat_interleave(consts["k"], dim=1).reshape(-1)  # [B * K]
    unit_off = torch.cumsum(unit_len, 0).sub_(unit_len)
    total = sum(inv.numel() * k for inv, k in zip(inverses, layout.group_k))
    idx = torch.empty(total, dtype=torch.int64, device=device)
    psw = torch.empty(total, dtype=table.dtype, device=device) if weights is not None else None
    any_mean = any(layout.feature_mean)
    for g, (inv, k) in enumerate(zip(inverses, layout.group_k)):
        n = inv.numel()
        fg = len(layout.group_features[g])
        lengths = stacked.index_select(0, consts["group_feats"][g]).reshape(-1)  # [F_g * B], bag of (feature, sample)
        bag_rows = (consts["group_cols"][g][:, None] + sample_rows[None, :]).reshape(-1)  # [F_g * B]
        bag_of_id = torch.repeat_interleave(torch.arange(fg * B, device=device), lengths, output_size=n)
        bag_start = torch.cumsum(lengths, 0).sub_(lengths)
        rank = torch.arange(n, device=device).sub_(bag_start.index_select(0, bag_of_id))  # position in its bag
        first_row = bag_rows.index_select(0, bag_of_id)
        id_len = lengths.index_select(0, bag_of_id)
        first = unit_off.index_select(0, first_row).add_(rank)  # where (id, t = 0) goes
        src = inv * k + bases[g]
        w = weights[g].to(table.dtype) if weights is not None else None
        if k == 1:
            idx.scatter_(0, first, src)
            if psw is not None:
                psw.scatter_(0, first, w)
        else:
            # Sub-unit t of a bag follows sub-unit t - 1, each as long as the bag.
            ar = consts["arange"][:k]
            dest = (first[:, None] + ar * id_len[:, None]).reshape(-1)
            idx.scatter_(0, dest, (src[:, None] + ar).reshape(-1))
            if psw is not None:
                psw.scatter_(0, dest, w[:, None].expand(-1, k).reshape(-1))
        scale = w
        if any_mean:
            is_mean = consts["group_mean"][g].repeat_interleave(B).index_select(0, bag_of_id)
            if bool(is_mean.any()):
                inv_len = torch.where(is_mean, id_len, 1).to(table.dtype).reciprocal_()
                scale = inv_len if scale is None else scale * inv_len
        grads.append(_GroupGrad(first_row, scale))
    out = F.embedding_bag(idx, table, unit_off, mode="sum", per_sample_weights=psw)  # [B * K, u]
    if any_mean:
        divisor = torch.where(consts["mean_cols"][None, :], unit_len.view(B, K).clamp(min=1), 1).to(out.dtype)
        out.div_(divisor.reshape(-1, 1))
    return _reshaped(out, (B, K * u)), grads


def _reshaped(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Contiguous ``t`` as ``shape``, not as a view: the output of an autograd Function that is a
    view made inside it could not be modified in place (``relu_``, ``detach_``)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), shape)


class BagGradients:
    """A group's gradient per unique row, [U_g, D_g], not summed yet: row i's is the sum of the
    concat gradient's slices (k unit rows each) at its ids ``order[starts[i] : starts[i + 1]]``.
    The fused update sums it in its own pass over the rows where it can
    (:func:`dynemb.kernels.update.update_rows_from_bags_native`: no [U_g, D_g] gradient written
    and read back); every other path takes :meth:`dense`. Only for what the compiled sum takes:
    unweighted float32 bags on CPU (:func:`group_gradient`)."""

    __slots__ = ("first_row", "grad_rows", "k", "num_unique", "order", "starts")

    def __init__(self, grad_rows: torch.Tensor, first_row: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, num_unique: int, k: int):
        self.grad_rows, self.first_row, self.order, self.starts, self.num_unique, self.k = grad_rows, first_row, order, starts, num_unique, k

    @property
    def dtype(self) -> torch.dtype:
        return self.grad_rows.dtype

    def dense(self) -> torch.Tensor:
        """The gradient [U_g, D_g] (:func:`dynemb.kernels.pool.sum_bags_native`)."""
        return sum_bags_native(self.grad_rows, self.first_row, self.order, self.starts, self.num_unique, self.k)

    def update_rows(self, table: torch.Tensor, rows: torch.Tensor, spec: dict, *, check: bool) -> torch.Tensor | None:
        """The optimizer step ``spec`` on the rows [U_g] of ``table`` with this gradient, summed
        in the same pass (:func:`dynemb.kernels.update.update_rows_from_bags_native`, the same
        arguments and result as :func:`dynemb.kernels.update.update_rows_native`)."""
        return update_rows_from_bags_native(table, rows, self.grad_rows, self.first_row, self.order, self.starts, self.k, spec, check=check)


def dense_gradient(grads: torch.Tensor | BagGradients) -> torch.Tensor:
    """``grads`` as a tensor [U, D] (a :class:`BagGradients` summed)."""
    return grads.dense() if isinstance(grads, BagGradients) else grads


def group_gradient(
    grad_rows: torch.Tensor,
    info: _GroupGrad,
    order: torch.Tensor,
    starts: torch.Tensor,
    num_unique: int,
    k: int,
    native: bool = False,
) -> torch.Tensor | BagGradients:
    """Gradient [U_g, D_g] of a group's unique rows from the concat gradient in unit rows
    [B * K, u]; ``order`` [N_g] lists the ids by unique row, ``starts`` [U_g] where each row's
    ids begin. ``native``: unweighted float32 on CPU is left to the compiled kernels, as a
    :class:`BagGradients` (summed by :func:`dynemb.kernels.pool.sum_bags_native`, or in the
    update's pass; the ids in the same order either way)."""
    if native and info.scale is None and grad_rows.dtype == torch.float32 and grad_rows.device.type == "cpu":
        return BagGradients(grad_rows, info.first_row, order, starts, num_unique, k)
    return sum_bags_torch(grad_rows, info.first_row, order, starts, num_unique, k, info.scale)
