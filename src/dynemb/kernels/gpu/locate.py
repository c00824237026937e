"""Triton twin of :mod:`dynemb.kernels.locate`: the two candidate buckets of keys and the flat
slot (and row id) of each key in the bucketed index.

N keys, B buckets, W slots per bucket. A key may live at any slot of its two candidate buckets
(b1, b2); its slot is the first match among b1's W slots, then b2's (as ``locate_torch``). A
program takes BLOCK keys and loads their buckets as [BLOCK, W] tiles; b2's tile is read only
for the keys b1 did not hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynemb.kernels.gpu import launch_options
from dynemb.kernels.gpu.common import bucket_of, mix64

# Keys a program takes times the (padded) bucket width: one tile of about this many slots.
TILE = 2048


@triton.jit
def _locate_kernel(
    table_keys,  # [B, W] int64, slot p's key at p * key_step
    used,  # [B, W] uint8 tags: 0 where empty (read as a used flag here)
    table_rows,  # [B, W] int32 or int64 (read when HAS_ROWS), slot p's at p * row_step
    key_step,  # 1, or 2 when the slots are packed (docs/design/0041)
    row_step,
    W,
    total_buckets,
    keys,  # [N] int64
    seg,  # [N] int64 segment of each key (read when HAS_SEG)
    seg_counts,  # [S] buckets of each segment
    seg_offsets,  # [S] first bucket of each segment
    n,
    pos_out,  # [N] int64 flat slot, -1 where absent (or b1 when not PROBE)
    found_out,  # [N] bool (or b2, int64, when not PROBE)
    rows_out,  # [N] int64 row id, -1 where absent (when HAS_ROWS)
    HAS_SEG: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    PROBE: tl.constexpr,
    WP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    key = tl.load(keys + i, mask=m, other=0)
    if HAS_SEG:
        s = tl.load(seg + i, mask=m, other=0)
        nb = tl.load(seg_counts + s, mask=m, other=1)
        off = tl.load(seg_offsets + s, mask=m, other=0)
    else:
        nb = tl.full([BLOCK], 0, tl.int64) + total_buckets
        off = tl.full([BLOCK], 0, tl.int64)
    mixed = mix64(key.to(tl.uint64, bitcast=True))
    b1 = bucket_of(mixed, nb) + off
    b2 = bucket_of(mix64(mixed), nb) + off
    if not PROBE:
        tl.store(pos_out + i, b1, mask=m)
        tl.store(found_out + i, b2, mask=m)
    else:
        j = tl.arange(0, WP)
        tile = m[:, None] & (j < W)[None, :]
        base1 = b1 * W
        slots1 = base1[:, None] + j[None, :]
        hit1 = (tl.load(table_keys + slots1 * key_step, mask=tile, other=0) == key[:, None]) & (tl.load(used + slots1, mask=tile, other=0) != 0) & tile
        j1 = tl.min(tl.where(hit1, j[None, :], WP), axis=1)
        # The second bucket only for the keys the first did not hold.
        tile2 = tile & (j1 == WP)[:, None]
        base2 = b2 * W
        slots2 = base2[:, None] + j[None, :]
        hit2 = (tl.load(table_keys + slots2 * key_step, mask=tile2, other=0) == key[:, None]) & (tl.load(used + slots2, mask=tile2, other=0) != 0) & tile2
        j2 = tl.min(tl.where(hit2, j[None, :], WP), axis=1)
        at = tl.where(j1 < WP, base1 + j1, tl.where(j2 < WP, base2 + j2, -1))
        tl.store(pos_out + i, at, mask=m)
        tl.store(found_out + i, at >= 0, mask=m)
        if HAS_ROWS:
            r = tl.load(table_rows + at * row_step, mask=m & (at >= 0), other=-1).to(tl.int64)
            tl.store(rows_out + i, r, mask=m)


def _launch(table_keys, used, table_rows, W: int, total_buckets: int, segments, keys, seg, probe: bool, outs) -> None:
    """One launch over the N keys: candidates only (``probe`` False, outs = b1, b2) or the probe
    (outs = pos, found, rows)."""
    n = keys.numel()
    if n == 0:
        return
    WP = triton.next_power_of_2(W)
    block = max(1, TILE // WP)
    has_seg = seg is not None
    _locate_kernel[(triton.cdiv(n, block),)](
        table_keys,
        used,
        table_rows if table_rows is not None else table_keys,
        table_keys.stride(1) if probe else 1,
        table_rows.stride(1) if table_rows is not None else 1,
        W,
        total_buckets,
        keys,
        seg if has_seg else keys,
        segments.counts if has_seg else keys,
        segments.offsets if has_seg else keys,
        n,
        *outs,
        HAS_SEG=has_seg,
        HAS_ROWS=table_rows is not None,
        PROBE=probe,
        WP=WP,
        BLOCK=block,
        **launch_options(),
    )


def locate_triton(
    table_keys: torch.Tensor,
    used: torch.Tensor,
    segments,
    keys: torch.Tensor,
    seg: torch.Tensor | None,
    table_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Bitwise :func:`dynemb.kernels.locate.locate_native` (same arguments and results) on the
    index's device: flat slot of each key ([N] int64, -1 where absent), found ([N] bool), and
    row ids ([N] int64, -1 where absent) when ``table_rows`` is given."""
    keys = keys.contiguous()
    seg = None if seg is None else seg.contiguous()
    n, device = keys.numel(), keys.device
    pos = torch.empty(n, dtype=torch.int64, device=device)
    found = torch.empty(n, dtype=torch.bool, device=device)
    rows = None if table_rows is None else torch.empty(n, dtype=torch.int64, device=device)
    outs = (pos, found, rows if rows is not None else pos)
    _launch(table_keys, used, table_rows, table_keys.shape[1], table_keys.shape[0], segments, keys, seg, True, outs)
    return pos, found, rows


def candidates_triton(segments, keys: torch.Tensor, seg: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two candidate buckets of keys ([N] -> two [N] int64), bitwise
    :meth:`dynemb.table.geometry.Segments.candidates`."""
    keys = keys.contiguous()
    seg = None if seg is None else seg.contiguous()
    b1, b2 = torch.empty_like(keys), torch.empty_like(keys)
    _launch(keys, keys, None, 1, segments.total, segments, keys, seg, False, (b1, b2, b1))
    return b1, b2
