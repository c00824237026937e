"""Rebuilding: fresh engines filled with a checkpoint's rows (exact placement or re-insertion), swapped into the modules at the end.

K keys of a table, D embedding dim, S optimizer state columns.
"""

from __future__ import annotations

import torch

from dynemb.checkpoint.tables import Entry
from dynemb.errors import CheckpointError
from dynemb.nn.admission import FrequencyAdmission
from dynemb.nn.clock import loaded_scores
from dynemb.storage.caching import bind_held
from dynemb.table.exact import place_exact, state_from_layout, state_from_slots
from dynemb.table.index import unique_pairs
from dynemb.workspace import writable


def build_engine(sample: Entry, parts: list[tuple[int | None, dict, Entry]], *, on_overflow: str, use_layout: bool) -> tuple[object, dict]:
    """A fresh engine for one DynamicTable or one collection group, filled with ``parts``
    (segment, data with whole rows [K, D+S], entry); returns it and the keys dropped per table.
    Raises CheckpointError (nothing changed) if keys do not fit and ``on_overflow`` is "raise"."""
    # A sharded table's engine wraps the rank's local one: the fresh engine is a local one too.
    engine = sample.engine.local if sample.engine.collective else sample.engine
    grouped = engine.segmented

    def new_engine():
        return engine.fresh()

    fresh = new_engine()
    device = fresh.device
    names = [e.name for _, _, e in parts]
    keys = torch.cat([d["keys"] for _, d, _ in parts]).to(device)
    segs = torch.cat([torch.full((d["keys"].numel(),), 0 if s is None else s, dtype=torch.int64) for s, d, _ in parts]).to(device)
    # One table's block is used as it is (no copy); a group's tables are concatenated.
    values = (parts[0][1]["values"] if len(parts) == 1 else torch.cat([d["values"] for _, d, _ in parts])).to(device=device, dtype=fresh.store.dtype)
    scores = torch.cat([d["scores"] for _, d, _ in parts]).to(device)
    lost = torch.empty(0, dtype=torch.int64, device=device)  # segments of the keys dropped
    with writable():
        state = None
        if use_layout:
            c = parts[0][1]["entry"]["counters"].get("index", [0, 0, 0, 0]) if not grouped else [0, 0, 0, 0]
            state = state_from_layout(fresh.index, [(s, d.get("layout"), d["keys"], d["scores"]) for s, d, _ in parts], c)
        if state is not None:
            try:
                fresh.index.load_state_dict(state)
            except ValueError:
                # A layout that does not hold together (a damaged file, verify=False): re-insert.
                state = None
        if state is not None:
            fresh.store.reserve(keys.numel())
            bind_held(fresh.store, fresh.index, fresh.num_tables if grouped else None)
            fresh.store.scatter(torch.arange(keys.numel(), device=device), values)
        elif keys.numel():
            # The order resolve wants: by segment, then key.
            if grouped:
                (segs, keys), inverse, _ = unique_pairs(segs, keys)
                order = torch.empty_like(inverse).index_copy_(0, inverse, torch.arange(inverse.numel(), device=device))
            else:
                keys, order = torch.sort(keys)
            # Values stay in file order: src[i] is the value row of the i-th key in resolve order.
            src, scores = order, scores.index_select(0, order)
            # Keys beyond a table's capacity cannot fit: only the highest-priority ones (higher
            # score, then smaller key) go in first; the others may take slots left free.
            keep = torch.ones_like(keys, dtype=torch.bool)
            for s in torch.unique(segs).tolist():
                members = (segs == s).nonzero().squeeze(1)
                capacity = fresh.index.segment_capacity(s) if grouped else fresh.index.capacity()
                if members.numel() > capacity:
                    by_priority = torch.sort(scores.index_select(0, members), descending=True, stable=True).indices
                    keep.index_fill_(0, members.index_select(0, by_priority[capacity:]), False)
            if not bool(keep.all()) and on_overflow != "evict":
                raise CheckpointError(
                    f"{int((~keep).sum())} of the {keys.numel()} keys of tables {names} exceed the tables' capacity; "
                    "load into larger tables, or pass on_overflow='evict' to keep the highest-scored keys"
                )
            seg_arg = (segs[keep],) if grouped else ()
            r = fresh.resolve(keys[keep], *seg_arg, train=True, now=0, scores=scores[keep], init_rows=False)
            if bool(keep.all()) and not r.failed_keys.numel() and not r.evicted_keys.numel():
                fresh.store.scatter(torch.empty_like(src).index_copy_(0, src, r.rows), values)
            else:
                # A batch insert does not always find a placement of a nearly full index even
                # where one exists: place the keys it left out along cuckoo paths, then build
                # the index from the slots found.
                slots = torch.full_like(keys, -1)
                slots[keep] = fresh.index.locate(keys[keep], *seg_arg)[0]
                slots = place_exact(fresh.index, keys, segs if grouped else None, scores, slots, evict=on_overflow == "evict", optional=~keep)
                placed = slots >= 0
                if not bool(placed.all()):
                    if on_overflow != "evict":
                        raise CheckpointError(
                            f"{int((~placed).sum())} of the {keys.numel()} keys of tables {names} do not fit (bucket overflow); "
                            "load into larger tables, or pass on_overflow='evict' to keep the highest-scored keys"
                        )
                    lost = segs[~placed]
                    keys, segs, src, scores, slots = keys[placed], segs[placed], src[placed], scores[placed], slots[placed]
                index = fresh.index
                geometry = (index.num_buckets, index.bucket_capacity, index.max_buckets)
                fresh = new_engine()
                fresh.index.load_state_dict(state_from_slots(fresh.index, keys, slots, scores, geometry, [0, 0, 0, 0], index.segment_buckets.tolist()))
                fresh.store.reserve(keys.numel())
                bind_held(fresh.store, fresh.index, fresh.num_tables if grouped else None)
                if src.numel() == values.shape[0]:
                    fresh.store.scatter(torch.empty_like(src).index_copy_(0, src, torch.arange(src.numel(), device=device)), values)
                else:
                    fresh.store.scatter(torch.arange(src.numel(), device=device), values.index_select(0, src))
        fresh.version += 1
    dropped = {e.name: int((lost == (0 if s is None else s)).sum()) for s, _, e in parts}
    return fresh, dropped


def current_rows(e: Entry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A table's keys [K], whole rows [K, D+S] and scores [K] as it holds them now (on CPU)."""
    engine = e.engine
    chunks = list(e.export(1 << 20))
    if not chunks:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, torch.empty(0, engine.width, dtype=engine.store.dtype), empty
    rows = torch.cat([c[1] for c in chunks])
    keys, scores = (torch.cat([c[i] for c in chunks]).cpu() for i in (0, 2))
    return keys, engine.store.gather(rows.to(engine.device)).cpu(), scores


def plan_engines(es: list[Entry], data: dict, *, on_overflow: str, use_layout: bool) -> tuple[list, dict]:
    """A fresh engine for every table module or collection group that ``data`` (table name ->
    keys, whole rows, scores, manifest entry) covers; tables it does not cover keep their
    current rows. Returns the plans (members, fresh engine, parts) for :func:`install` and the
    report ``{name: {"rows", "dropped"}}``; raises (nothing changed) when keys do not fit. A
    timestamp table's nanosecond scores in ``data`` are replaced by seconds (nn/clock.py)."""
    plans, report = [], {}
    groups: dict[int, list[Entry]] = {}
    for e in es:
        groups.setdefault(id(e.engine), []).append(e)
        if e.name in data:
            # A timestamp table's nanosecond scores (written before docs/design/0036) in seconds.
            data[e.name]["scores"] = loaded_scores(data[e.name]["scores"], e.config.score_strategy)
    for members in groups.values():
        if not any(e.name in data for e in members):
            continue
        parts = []
        for e in members:
            if e.name in data:
                parts.append((e.location[1], data[e.name], e))
            else:
                # Not in the checkpoint (strict=False): keep its current rows.
                k, vals, sc = current_rows(e)
                parts.append((e.location[1], {"keys": k, "values": vals, "scores": sc}, e))
        fresh, dropped = build_engine(members[0], parts, on_overflow=on_overflow, use_layout=use_layout and all(e.name in data for e in members))
        plans.append((members, fresh, parts))
        for _, d, e in parts:
            if e.name in data:
                report[e.name] = {"rows": int(d["keys"].numel()) - dropped[e.name], "dropped": dropped[e.name]}
    return plans, report


def admission_of(e: Entry, d: dict):
    """A new admission counter for table ``e`` holding the checkpoint's counts (empty if the
    checkpoint has none)."""
    current = e.admission
    adm = FrequencyAdmission(e.config.admission, current.counts.device)
    if d.get("admission") is not None:
        try:
            adm.load_state_dict(d["admission"])
        except (ValueError, KeyError, RuntimeError, TypeError) as error:
            raise CheckpointError(f"table {e.name!r}: not an admission counter state ({error})", d["admission_path"]) from None
    return adm


def install(members: list[Entry], fresh, parts, data: dict, optimizer_state: bool) -> None:
    """Swap ``fresh`` (built by :func:`build_engine`) into the module of ``members`` with the
    checkpoint's counters; tables of the group that the checkpoint does not hold (strict=False)
    keep their step count, counters and generator."""
    module = members[0].module
    for s, d, e in parts:
        table = e.module_table
        segment = s or 0
        if e.name not in data:
            old = e.engine.counters(segment)
            fresh.set_counters(
                segment,
                optimizer_step=old["optimizer_step"],
                nonfinite_grads=old["nonfinite_grads"],
                index=old["index"],
                generator_state=old["generator"].get_state(),
            )
            continue
        c = d["entry"]["counters"]
        idx = c.get("index")
        fresh.set_counters(
            segment,
            optimizer_step=c["optimizer_step"] if optimizer_state else 0,
            nonfinite_grads=c["nonfinite_grads"],
            index=idx if isinstance(idx, list) and len(idx) == 4 else None,
            generator_state=d.get("generator"),
        )
        module.set_clock(c["step"], c["last_timestamp"])
        module.restore_table(table, erased=c["erased"], admission=d.get("admission"))
    old_engine = members[0].engine
    if old_engine.collective:
        fresh = old_engine.rebuilt(fresh)
    elif old_engine.given_store:
        # Every engine of the load is built and checked by now: a table's own row store (which
        # may be another tier) takes the loaded rows back.
        fresh.adopt_store(old_engine.store)
    module.install_engine(module.engines.index(old_engine), fresh)
