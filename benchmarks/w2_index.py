"""W2, index micro-benchmark: dynemb.KeyIndex find / find_or_insert / insert at load factors 0.5
and 0.9, and how full the index gets before its first eviction.

N keys per call, C index capacity, P keys present in the index.

The index (C = 2**22 slots, the default bucket width, timestamp scores; the clock ``now`` is the
call count) is filled with random int64 keys to the target load factor; then, per repeat,
``steps`` calls of N keys are timed. ``find`` queries present keys drawn uniformly (with
repeats); ``find_or_insert`` queries the same mix with a fraction NEW_FRACTION of never-seen
keys; ``insert`` is a find_or_insert of N never-seen keys. After each timed find_or_insert or
insert call the new keys are erased (untimed), so every call runs at the target load factor.
The index runs the backend its options choose (``auto``: the compiled kernels where they build;
``DYNEMB_BACKEND=torch`` measures the plain-torch index).

First eviction (untimed): a fresh index of the same options takes distinct random keys in
batches of N until a call evicts or fails a key; the load factor then is recorded and must be
at least FIRST_EVICTION_MIN. Filling goes on past the capacity (load 1.0, evicting). Every call
of this fill, and every timed find_or_insert and erase, is checked against a set of the keys the
index should hold: keys before + new keys = keys after + evicted + failed, and each key that
left is reported; at loads 0.5, 0.9, 0.95 and 1.0 the index's keys must equal that set. The
timed calls are checked once a repeat's calls are timed, from the sizes and reported keys
(evicted, failed) recorded around each: the set holds millions of Python ints, and walking it
between timed calls evicted the index's lines from the caches, so that find_or_insert and
insert ran cold while find (no check) ran warm (perf-log 2026-11-26, fourth session). Only the
reported keys are kept, not the calls' whole results, which are freed as a step frees them
(perf-log 2026-11-27, thirteenth session).

References, measured in the same repeat on the same queries:
* ``dict``: a Python dict key -> row id holding the same P keys, called as a user with tensors
  would: ``keys.tolist()``, ``d.get`` / ``d.setdefault`` per key, ``torch.tensor`` of the rows.
* ``sorted-array`` (find only): the P keys sorted once, ``torch.searchsorted`` + equality check
  + row gather; a static index, the usual vectorised torch way to map known keys to rows.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import NamedTuple

import torch

import dynemb
from dynemb.table.index import rounded_capacity
from harness import OthersLoad, paired_ratio, quiet_repeats, record, settle
from keygen import distinct_keys

KEYS_PER_CALL = 65536
CAPACITY = 1 << 22
# The index's own default bucket width, so W2 measures the configuration users get.
BUCKET_CAPACITY = inspect.signature(dynemb.KeyIndex).parameters["bucket_capacity"].default
LOAD_FACTORS = (0.5, 0.9)
NEW_FRACTION = 0.1
# Fill keys come from scramble(0 ..), never-seen query keys from scramble(NEW_BASE ..): disjoint.
NEW_BASE = 1 << 40
FILL_SLACK = 4096
FIRST_EVICTION_MIN = 0.95
CHECKED_LOADS = (0.5, 0.9, 0.95, 1.0)
# First-eviction keys come from scramble(FIRST_BASE ..), disjoint from the others.
FIRST_BASE = 1 << 50


@dataclasses.dataclass(frozen=True, kw_only=True)
class W2Config:
    steps: int  # timed calls per repeat and contender
    repeats: int
    max_retries: int  # repeats that may be discarded because other processes loaded the CPUs
    seed: int = 0


class DictIndex:
    """The dict reference: key -> row id, new keys get the next row ids."""

    def __init__(self, keys: torch.Tensor, rows: torch.Tensor):
        self.d = dict(zip(keys.tolist(), rows.tolist()))
        self.next_row = int(rows.max()) + 1 if rows.numel() else 0

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        get = self.d.get
        rows = torch.tensor([get(k, -1) for k in keys.tolist()], dtype=torch.int64)
        return rows, rows >= 0

    def find_or_insert(self, keys: torch.Tensor) -> torch.Tensor:
        # Position-based candidate ids are distinct, so each new key gets its own row id.
        setdefault, base = self.d.setdefault, self.next_row
        rows = torch.tensor([setdefault(k, base + i) for i, k in enumerate(keys.tolist())], dtype=torch.int64)
        self.next_row += keys.numel()
        return rows

    def erase(self, keys: torch.Tensor) -> None:
        pop = self.d.pop
        for k in keys.tolist():
            pop(k, None)


class SortedArrayIndex:
    """The static reference for find: sorted keys [P] and their rows [P]."""

    def __init__(self, keys: torch.Tensor, rows: torch.Tensor):
        self.keys, order = torch.sort(keys)
        self.rows = rows.index_select(0, order)

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.searchsorted(self.keys, keys).clamp_(max=self.keys.numel() - 1)  # [N]
        found = self.keys.index_select(0, pos) == keys
        rows = torch.where(found, self.rows.index_select(0, pos), -1)
        return rows, found


class Ledger:
    """The keys an index should hold, as a Python set, updated from each call's result: nothing
    may leave the index without being reported."""

    def __init__(self, index: dynemb.KeyIndex):
        self.index = index
        self.held: set[int] = set()

    def inserted(self, keys: torch.Tensor, size_before: int, r, size_after: int | None = None) -> None:
        """Check a find_or_insert of ``keys`` that took the index from ``size_before`` keys to
        ``size_after`` (default: its size now)."""
        size_after = self.index.size() if size_after is None else size_after
        batch = set(keys.tolist())
        new = batch - self.held
        evicted, failed = r.evicted_keys.tolist(), r.failed_keys.tolist()
        assert size_before + len(new) == size_after + len(evicted) + len(failed), "conservation"
        assert len(set(evicted)) == len(evicted) and all(k in self.held and k not in batch for k in evicted)
        assert len(set(failed)) == len(failed) and all(k in new for k in failed)
        self.held |= new
        self.held.difference_update(evicted)
        self.held.difference_update(failed)
        assert size_after == len(self.held)

    def erased(self, keys: torch.Tensor, size_before: int, r, size_after: int | None = None) -> None:
        size_after = self.index.size() if size_after is None else size_after
        gone = r.evicted_keys.tolist()
        assert sorted(gone) == sorted(set(keys.tolist()) & self.held) and size_before == size_after + len(gone)
        self.held.difference_update(gone)

    def verify(self) -> None:
        """The index holds exactly the keys of the ledger."""
        held = set()
        for keys, _, _ in self.index.export(1 << 20):
            held.update(keys.tolist())
        assert held == self.held, f"{len(held ^ self.held)} keys differ between the index and the ledger"


class Clock:
    """The ``now`` of the timestamp strategy: one tick per call."""

    def __init__(self):
        self.now = 0

    def tick(self) -> int:
        self.now += 1
        return self.now


def _fill(index: dynemb.KeyIndex, target: float, next_key: int, clock: Clock) -> int:
    """Insert fresh keys until ``index`` reaches load factor ``target``; returns the next key rank."""
    goal = int(target * index.capacity())
    while index.size() < goal:
        # A call adds at most n keys (those that land in full buckets evict instead), so the
        # load overshoots the target by at most FILL_SLACK / capacity.
        n = min(KEYS_PER_CALL, max(goal - index.size(), FILL_SLACK))
        index.find_or_insert(distinct_keys(next_key, n), now=clock.tick())
        next_key += n
    return next_key


def first_eviction(log) -> dict:
    """Fill a fresh index in batches of N past its capacity, checking every call (see module
    docstring); returns the figures of the first eviction."""
    index = dynemb.KeyIndex(capacity=CAPACITY, bucket_capacity=BUCKET_CAPACITY)
    ledger, clock = Ledger(index), Clock()
    checks = list(CHECKED_LOADS)
    first = None
    offered = 0
    t0 = time.perf_counter()
    # Up to the capacity in keys offered, then a few calls more: the index is full and evicts.
    while offered < index.capacity() + 4 * KEYS_PER_CALL:
        keys = distinct_keys(FIRST_BASE + offered, KEYS_PER_CALL)
        offered += KEYS_PER_CALL
        size = index.size()
        r = index.find_or_insert(keys, now=clock.tick())
        ledger.inserted(keys, size, r)
        if first is None and (r.evicted_keys.numel() or r.failed_keys.numel()):
            # The call filled every free slot it could reach before evicting: the keys held now
            # were all placed without loss.
            first = {
                "load_factor": index.load_factor(),
                "empty_slots": index.capacity() - index.size(),
                "load_factor_before_call": size / index.capacity(),
                "evicted": r.evicted_keys.numel(),
                "failed": r.failed_keys.numel(),
            }
            log(f"W2 first eviction at load factor {first['load_factor']:.5f} ({first['empty_slots']} empty slots)")
        while checks and checks[0] < 1.0 and index.load_factor() >= checks[0]:
            ledger.verify()
            checks.pop(0)
    ledger.verify()
    assert first is not None, "no eviction after filling past the capacity"
    assert first["load_factor"] >= FIRST_EVICTION_MIN, f"first eviction at load factor {first['load_factor']:.4f} < {FIRST_EVICTION_MIN}"
    stats = index.stats()
    log(
        f"W2 no key lost at loads {CHECKED_LOADS}: {offered} keys offered, {stats['evictions']} evicted, "
        f"{stats['failed_inserts']} failed, {time.perf_counter() - t0:.1f} s"
    )
    return {**first, "final_load_factor": index.load_factor(), "offered": offered, "stats": stats}


class _Reported(NamedTuple):
    """What the ledger reads of an IndexResult: the keys that left the index or found no slot."""

    evicted_keys: torch.Tensor
    failed_keys: torch.Tensor


def _reported(r) -> _Reported:
    return _Reported(r.evicted_keys, r.failed_keys)


def _present(index: dynemb.KeyIndex) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = list(index.export(1 << 20))
    return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])


def _keys_per_second(op, queries: list[torch.Tensor], after=None) -> tuple[float, float | None]:
    """Keys/s of ``op(q)`` over the queries (``after(i)`` runs untimed after call i), and other
    processes' CPU share meanwhile."""
    settle()
    load = OthersLoad()
    elapsed = 0.0
    for i, q in enumerate(queries):
        t0 = time.perf_counter()
        op(q)
        elapsed += time.perf_counter() - t0
        if after is not None:
            after(i)
    return sum(q.numel() for q in queries) / elapsed, load.share()


class _Session:
    """The index at one load factor, its references, and the query stream of its repeats."""

    def __init__(self, cfg: W2Config, index: dynemb.KeyIndex, load: float, gen: torch.Generator, next_new: int, clock: Clock, log):
        self.cfg, self.index, self.load, self.gen, self.next_new, self.log = cfg, index, load, gen, next_new, log
        self.clock = clock
        keys, rows = _present(index)
        self.dict_index, self.sorted_index = DictIndex(keys, rows), SortedArrayIndex(keys, rows)
        self.found_fraction: list[float] = []

    def _sample(self, present: torch.Tensor, n: int) -> torch.Tensor:
        return present.index_select(0, torch.randint(present.numel(), (n,), generator=self.gen))

    def repeat(self, attempt: int) -> tuple[dict[tuple[str, str], float], list[float | None]]:
        """Time every (op, contender) on fresh queries, in alternating order; returns keys/s and
        other processes' CPU share during each."""
        cfg, index = self.cfg, self.index
        # Present keys only: a find_or_insert of the previous repeat may have evicted some.
        present, _ = _present(index)
        finds = [self._sample(present, KEYS_PER_CALL) for _ in range(cfg.steps)]
        upserts, fresh = [], []
        n_new = int(NEW_FRACTION * KEYS_PER_CALL)
        for _ in range(cfg.steps):
            fresh.append(distinct_keys(self.next_new, n_new))
            self.next_new += n_new
            q = torch.cat([self._sample(present, KEYS_PER_CALL - n_new), fresh[-1]])
            upserts.append(q.index_select(0, torch.randperm(KEYS_PER_CALL, generator=self.gen)))
        # insert: calls of new keys only (erased again after each, untimed).
        inserts = []
        for _ in range(cfg.steps):
            inserts.append(distinct_keys(self.next_new, KEYS_PER_CALL))
            self.next_new += KEYS_PER_CALL
        found = sum(int(index.find(q)[1].sum()) for q in upserts)
        self.found_fraction.append(found / (cfg.steps * KEYS_PER_CALL))
        d, sa = self.dict_index, self.sorted_index
        clock = self.clock
        # Each timed call, in the order they run: size before, keys, result, size after, then
        # its erase's keys, result and size after. The ledger checks them once the calls are
        # timed (its Python sets of millions of keys would otherwise evict the index's lines
        # from the caches between timed calls).
        # Only the keys each call reports are kept: the results' [N] tensors (slots, row ids,
        # flags) are freed as a user's step frees them, not held to the end of the repeat, where
        # every timed call would take fresh pages for its outputs (perf-log, thirteenth session).
        calls: list[list] = []

        def upsert(q: torch.Tensor) -> None:
            size = index.size()
            calls.append([size, q, _reported(index.find_or_insert(q, now=clock.tick())), index.size()])

        def erase(leaving: list[torch.Tensor]):
            def after(i: int) -> None:
                calls[-1] += [leaving[i], _reported(index.erase(leaving[i])), index.size()]

            return after

        runs = [
            (("insert", "dynemb"), upsert, inserts, erase(inserts)),
            (("insert", "dict"), d.find_or_insert, inserts, lambda i: d.erase(inserts[i])),
            (("find", "dynemb"), index.find, finds, None),
            (("find", "dict"), d.find, finds, None),
            (("find", "sorted-array"), sa.find, finds, None),
            (("find_or_insert", "dynemb"), upsert, upserts, erase(fresh)),
            (("find_or_insert", "dict"), d.find_or_insert, upserts, lambda i: d.erase(fresh[i])),
        ]
        order = runs if attempt % 2 == 0 else runs[::-1]
        measured = {key: _keys_per_second(op, queries, after) for key, op, queries, after in order}
        # The present keys are this index's own; the ledger checks the new ones and the erases.
        ledger = Ledger(index)
        ledger.held = set(present.tolist())
        for before, keys, result, after, gone, erased, after_erase in calls:
            ledger.inserted(keys, before, result, after)
            ledger.erased(gone, after, erased, after_erase)
        assert index.size() == len(ledger.held)
        rates = {key: rate for key, (rate, _) in measured.items()}
        summary = ", ".join(f"{op}/{c} {v / 1e6:.2f}M keys/s" for (op, c), v in rates.items())
        self.log(f"W2 load {self.load} attempt {attempt}: {summary}")
        return rates, [share for _, share in measured.values()]


def run(cfg: W2Config, env: dict, log=print) -> list[dict]:
    gen = torch.Generator().manual_seed(cfg.seed)
    capacity = rounded_capacity(CAPACITY, None, BUCKET_CAPACITY)
    first = first_eviction(log)
    records = [
        record(
            workload="W2",
            case="first_eviction",
            contender="dynemb.KeyIndex",
            unit="empty slots",
            values=[first["empty_slots"]],
            env=env,
            extra={
                **first,
                "keys_per_call": KEYS_PER_CALL,
                "capacity": capacity,
                "bucket_capacity": BUCKET_CAPACITY,
                "no_loss_checked_at": list(CHECKED_LOADS),
            },
        )
    ]
    index = dynemb.KeyIndex(capacity=capacity, bucket_capacity=BUCKET_CAPACITY)
    clock = Clock()
    next_key, next_new = 0, NEW_BASE
    for load in LOAD_FACTORS:
        t0 = time.perf_counter()
        next_key = _fill(index, load, next_key, clock)
        session = _Session(cfg, index, load, gen, next_new, clock, log)
        fill_stats = index.stats()
        log(
            f"W2 load {load}: filled to {index.load_factor():.3f} ({index.size()} keys, "
            f"{fill_stats['evictions']} evictions so far) and built references in {time.perf_counter() - t0:.1f} s"
        )
        results, noise = quiet_repeats(session.repeat, cfg.repeats, cfg.max_retries, log)
        next_new = session.next_new
        rates = {key: [r[key] for r in results] for key in results[0]}
        end_stats = index.stats()
        extra = {
            "load_factor_target": load,
            "load_factor_after_fill": fill_stats["load_factor"],
            "load_factor_at_end": end_stats["load_factor"],
            "find_or_insert_new_fraction": NEW_FRACTION,
            "find_or_insert_found_fraction": sum(session.found_fraction) / len(session.found_fraction),
            "evictions_during_find_or_insert": end_stats["evictions"] - fill_stats["evictions"],
            "keys_per_call": KEYS_PER_CALL,
            "steps": cfg.steps,
            "repeats": cfg.repeats,
            **noise,
            "capacity": capacity,
            "bucket_capacity": BUCKET_CAPACITY,
        }
        for op in ("find", "find_or_insert", "insert"):
            refs = ("dict", "sorted-array") if op == "find" else ("dict",)
            case = f"{op}@{load}"
            ratios = {ref: paired_ratio(rates[(op, "dynemb")], rates[(op, ref)], ref) for ref in refs}
            records.append(
                record(
                    workload="W2",
                    case=case,
                    contender="dynemb.KeyIndex",
                    unit="keys/s",
                    values=rates[(op, "dynemb")],
                    env=env,
                    ratio=ratios["dict"],
                    extra={**extra, "ratios": ratios},
                )
            )
            for ref in refs:
                records.append(
                    record(
                        workload="W2",
                        case=case,
                        contender=ref,
                        unit="keys/s",
                        values=rates[(op, ref)],
                        env=env,
                        extra=extra,
                    )
                )
        del session
    return records
