"""Random find / insert / erase / export / state_dict sequences on KeyIndex against a dict model.

The model (key -> row id, score) predicts exactly what does not depend on where keys sit: found
flags, row ids of held keys, every score, and the conservation law of HierarchicalKV (keys before +
new keys = keys after + evicted + failed; an erase counts its keys as leaving). Which new keys
fail or evict depends on bucket placement, so the machine checks that each such outcome is
justified by the documented rules (ScoreStrategy's docstring), reading the placement after the
call (priority between the new keys of one batch is checked in test_index_adversarial.py):

* a failed key: both candidate buckets are full, of keys used in this batch or, where eviction
  is allowed, scored higher than the failed key (lfu: of keys used in this batch only);
* an evicted key: was held, was not used in this batch, scored no higher than the key that took
  its slot (and its row id; lfu: any score), and no unused key left in that key's buckets scored
  lower (on a tie, the victim came first: bucket 1 before bucket 2, then the lower slot);
* eviction and failure happen only at full capacity; below it, size <= max_load_factor * slots;
* every held key sits in one of its candidate buckets; a call without new keys moves none.

Small buckets (W=4) and a small key pool holding 0, -1 and the int64 extremes fill buckets fast.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from index_model import INT64_MAX, INT64_MIN, DictModel, candidates, export_all, layout

from dynemb.table.index import KeyIndex, plan_buckets

POOL = [
    0, -1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, -2, -3, -144, 1 << 32, -(1 << 32), 1 << 40,
    123456789, -987654321, INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1, 7, 1000, -1000, 4096,
]  # fmt: skip
BATCH = st.lists(st.sampled_from(POOL), max_size=14)
# Erase fewer keys than inserts bring, so buckets stay full and evictions keep happening.
ERASE_BATCH = st.lists(st.sampled_from(POOL), max_size=4)
# Few distinct values so that ties are common, plus the extremes.
CUSTOM_SCORES = st.one_of(st.integers(-3, 3), st.sampled_from([INT64_MIN, INT64_MAX]))
# lfu scores given for a warm start are counts.
LFU_SCORES = st.integers(0, 4)

# Shrinking a failing run can take minutes; DYNEMB_TEST_SHRINK=1 turns it on for a minimal repro.
_SHRINK = os.environ.get("DYNEMB_TEST_SHRINK") == "1"
_PHASES = tuple(p for p in Phase if _SHRINK or p is not Phase.shrink)
SETTINGS = settings(
    max_examples=int(os.environ.get("DYNEMB_TEST_EXAMPLES", "30")),
    phases=_PHASES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def tb(values: list[bool]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


class IndexMachine(RuleBasedStateMachine):
    strategy = "customized"
    capacity = 16
    init_capacity: int | None = None
    bucket_capacity = 4
    max_load_factor = 0.75
    # Whether inserts pass scores=: "always", "sometimes" or "never".
    given_scores = "always"
    score_values = CUSTOM_SCORES

    def __init__(self):
        super().__init__()
        W = self.bucket_capacity
        self.init_buckets, max_buckets = plan_buckets(self.capacity, self.init_capacity, W)
        self.index = KeyIndex(
            capacity=self.capacity,
            init_capacity=self.init_capacity,
            bucket_capacity=W,
            max_load_factor=self.max_load_factor,
            score_strategy=self.strategy,
        )
        assert self.index.capacity() == max_buckets * W >= self.capacity
        assert self.index.current_capacity() == self.init_buckets * W
        self.model = DictModel(self.strategy)
        self.erased = 0

    def key_set(self) -> set[int]:
        return set(export_all(self.index)[0].tolist())

    @rule(keys=BATCH)
    def find(self, keys):
        rows, found = self.index.find(t(keys).view(-1, 1))
        assert rows.shape == found.shape == (len(keys), 1)
        assert torch.equal(found.view(-1), tb([k in self.model.row for k in keys]))
        assert torch.equal(rows.view(-1), t([self.model.row.get(k, -1) for k in keys]))

    def _call(self, entry: str, keys: list[int], scores: list[int] | None):
        """The insert through ``entry``; returns (per-key rows, found, inserted, positions, result)."""
        given = None if scores is None else t(scores)
        # lfu and customized do not read the clock: passing it or not makes no difference.
        now = self.model.now if self.strategy not in ("lfu", "customized") or len(keys) % 2 else None
        if entry == "find_or_insert":
            r = self.index.find_or_insert(t(keys), now=now, scores=given)
            return r.rows, r.found, r.inserted, r.positions, r
        unique = sorted(set(keys))
        counts = t([keys.count(k) for k in unique])
        if scores is not None:
            batch = self.model.batch_scores(keys, scores)
            given = t([batch[k] for k in unique])
        r = self.index.upsert_unique(t(unique), counts, now=now, given=given)
        at = {k: i for i, k in enumerate(unique)}
        idx = t([at[k] for k in keys])
        return r.rows[idx], r.found[idx], r.inserted[idx], r.positions[idx], r

    @rule(keys=BATCH, data=st.data(), entry=st.sampled_from(["find_or_insert", "upsert_unique"]))
    def insert(self, keys, data, entry):
        model, W = self.model, self.bucket_capacity
        scores = None
        if self.given_scores == "always" or (self.given_scores == "sometimes" and data.draw(st.booleans())):
            scores = data.draw(st.lists(self.score_values, min_size=len(keys), max_size=len(keys)), label="scores")
        before = set(model.row)
        before_rows = set(model.row.values())
        old_row, old_score = dict(model.row), dict(model.score)
        batch = model.batch_scores(keys, scores)
        capacity_before = self.index.current_capacity()
        where_before = layout(self.index)

        rows, found, inserted, positions, result = self._call(entry, keys, scores)
        ok = rows >= 0
        assert torch.equal(result.ok, result.rows >= 0)
        assert torch.equal(inserted, ok & ~found)
        after = self.key_set()
        failed_list = result.failed_keys.tolist()
        failed = set(failed_list)
        evicted_list = result.evicted_keys.tolist()
        evicted = set(evicted_list)
        new = set(keys) - before
        placed = new - failed

        # HKV's conservation law, from the index's own outputs.
        assert len(failed) == len(failed_list) and len(evicted) == len(evicted_list)
        assert before | new == after | evicted | failed
        assert len(before) + len(new) == len(after) + len(evicted) + len(failed)
        assert len(before) + len({k for k, i in zip(keys, inserted.tolist()) if i}) == len(after) + len(evicted)
        assert evicted <= before and not evicted & after and not evicted & set(keys)
        assert failed <= new and not failed & after
        if evicted or failed:
            assert self.index.current_capacity() == self.index.capacity()
        if self.strategy == "no_eviction":
            assert not evicted
        if not new:
            assert self.index.current_capacity() == capacity_before
            assert {k: b for k, b in layout(self.index).items()} == where_before, "a call without new keys moved keys"

        # Per key: found, ok, row ids and positions.
        assert torch.equal(found, tb([k in before for k in keys]))
        assert torch.equal(ok, tb([k not in failed for k in keys]))
        where = layout(self.index)
        for k, p in zip(keys, positions.tolist()):
            assert p == (-1 if k in failed else where[k][0] * W + where[k][1])
        got_row = {}
        for k, r in zip(keys, rows.tolist()):
            assert got_row.setdefault(k, r) == r, f"duplicates of key {k} got rows {got_row[k]} and {r}"
        for k in set(keys) - new:
            assert got_row[k] == old_row[k]
        for k in failed:
            assert got_row[k] == -1
        victim_of_row = {old_row[v]: v for v in evicted}
        assert torch.equal(result.evicted_rows, t([old_row[v] for v in evicted_list]))
        assert torch.equal(result.evicted_scores, t([old_score[v] for v in evicted_list]))
        fresh = {k for k in placed if got_row[k] not in victim_of_row}
        assert len({got_row[k] for k in placed}) == len(placed)
        assert {got_row[k] for k in placed - fresh} == set(victim_of_row)
        for k in fresh:
            assert 0 <= got_row[k] < self.index.capacity() and got_row[k] not in before_rows

        # The model takes the call's outcome.
        model.apply_found(keys, batch, scores is not None)
        for v in evicted:
            del model.row[v], model.score[v]
        for k in placed:
            model.row[k], model.score[k] = got_row[k], batch[k]
        model.stats["inserts"] += len(placed)
        model.stats["evictions"] += len(evicted)
        model.stats["failed_inserts"] += len(failed)

        # Each failure and eviction is justified by the rules.
        B = self.index.num_buckets
        occupants: dict[int, list[int]] = {}
        for k, (b, _) in where.items():
            occupants.setdefault(b, []).append(k)
        used = set(keys)
        evicting = self.strategy != "no_eviction"
        lfu = self.strategy == "lfu"
        for k in failed:
            for b in set(candidates(k, B)):
                assert len(occupants.get(b, [])) == W, f"failed key {k}: its bucket {b} has a free slot"
                for o in occupants[b] if evicting else ():
                    assert o in used or (not lfu and model.score[o] > batch[k]), (
                        f"failed key {k} (score {batch[k]}) could have evicted {o} (score {model.score[o]})"
                    )
        for k in placed - fresh:
            v = victim_of_row[got_row[k]]
            b, s = where[k]
            assert b in candidates(v, B) and (lfu or old_score[v] <= batch[k])
            first = candidates(k, B)[0]
            for c in set(candidates(k, B)):
                assert len(occupants[c]) == W, f"key {k} evicted {v} while its bucket {c} had a free slot"
                for o in occupants[c]:
                    if o in used:
                        continue
                    ob, os_ = where[o]
                    assert (model.score[o], ob != first, os_) > (old_score[v], b != first, s), (
                        f"key {k} evicted {v} (score {old_score[v]}, slot {(b, s)}) but not {o} (score {model.score[o]}, slot {(ob, os_)})"
                    )

    @rule(keys=ERASE_BATCH)
    def erase(self, keys):
        model = self.model
        present = [k in model.row for k in keys]
        size = self.index.size()
        r = self.index.erase(t(keys))
        gone = sorted(set(keys) & set(model.row))
        assert torch.equal(r.found, tb(present))
        assert torch.equal(r.rows, t([-1] * len(keys))) and torch.equal(r.positions, t([-1] * len(keys)))
        assert not r.inserted.any() and r.failed_keys.numel() == 0 and not r.ok.any()
        assert torch.equal(r.evicted_keys, t(gone))
        assert torch.equal(r.evicted_rows, t([model.row[k] for k in gone]))
        assert torch.equal(r.evicted_scores, t([model.score[k] for k in gone]))
        # Conservation: the erased keys leave.
        assert size == self.index.size() + len(gone)
        for k in gone:
            del model.row[k], model.score[k]

    @rule(chunk_size=st.integers(1, 40))
    def export(self, chunk_size):
        keys, rows, scores = export_all(self.index, chunk_size)
        full = export_all(self.index)
        order, full_order = keys.argsort(), full[0].argsort()
        assert torch.equal(keys[order], full[0][full_order])
        assert torch.equal(rows[order], full[1][full_order])
        assert torch.equal(scores[order], full[2][full_order])

    @rule(ticks=st.integers(0, 3))
    def advance_clock(self, ticks):
        self.model.now += ticks

    @rule()
    def state_round_trip(self):
        """A fresh index of the same arguments restores the state; it then replaces this one."""
        state = self.index.state_dict()
        assert all(v.dtype == torch.int64 for v in state.values())
        twin = KeyIndex(
            capacity=self.capacity,
            init_capacity=self.init_capacity,
            bucket_capacity=self.bucket_capacity,
            max_load_factor=self.max_load_factor,
            score_strategy=self.strategy,
        )
        twin.load_state_dict(state)
        for name, value in twin.state_dict().items():
            assert torch.equal(value, state[name]), name
        # A load stores scores as int32 again when the state's fit, though the saved index had
        # widened them (docs/design/0035): its memory figures may be smaller; the rest is equal.
        memory = ("index_bytes", "index_bytes_per_key")
        ours, theirs = twin.stats(), self.index.stats()
        assert all(ours[m] <= theirs[m] for m in memory)
        assert layout(twin) == layout(self.index) and {k: v for k, v in ours.items() if k not in memory} == {k: v for k, v in theirs.items() if k not in memory}
        self.index = twin

    @invariant()
    def agrees_with_model(self):
        keys, rows, scores = export_all(self.index)
        model = self.model
        assert self.index.size() == keys.numel() == len(model.row)
        assert keys.unique().numel() == keys.numel()
        assert dict(zip(keys.tolist(), rows.tolist())) == model.row
        assert rows.unique().numel() == rows.numel()
        assert bool(((rows >= 0) & (rows < self.index.capacity())).all())
        assert self.index.free_list.num_used() == self.index.size()
        assert bool((rows < self.index.free_list.high_water).all())
        assert dict(zip(keys.tolist(), scores.tolist())) == model.score

        pool = t(POOL)
        rows, found = self.index.find(pool)
        assert torch.equal(found, tb([k in model.row for k in POOL]))
        assert torch.equal(rows, t([model.row.get(k, -1) for k in POOL]))
        pool_scores, found = self.index.scores(pool)
        assert torch.equal(found, tb([k in model.row for k in POOL]))
        assert torch.equal(pool_scores, t([model.score.get(k, 0) for k in POOL]))

        # Every key sits in one of its candidate buckets.
        where = layout(self.index)
        assert set(where) == set(model.row)
        assert all(b in candidates(k, self.index.num_buckets) for k, (b, _) in where.items())

        current = self.index.current_capacity()
        growths = (current // (self.init_buckets * self.bucket_capacity)).bit_length() - 1
        assert current == self.init_buckets * self.bucket_capacity << growths <= self.index.capacity()
        if current < self.index.capacity():
            assert self.index.size() <= self.max_load_factor * current
        model.stats["growths"] = growths
        stats = self.index.stats()
        assert stats["size"] == len(model.row) and stats["current_capacity"] == current
        assert {k: stats[k] for k in model.stats} == model.stats


def _case(name: str, **attrs):
    machine = type(name, (IndexMachine,), attrs)
    machine.TestCase.settings = SETTINGS
    return machine.TestCase


TestCustomized = _case("CustomizedMachine", strategy="customized")
TestTimestamp = _case("TimestampMachine", strategy="timestamp", given_scores="never")
TestStep = _case("StepMachine", strategy="step", given_scores="sometimes", score_values=CUSTOM_SCORES)
TestLfu = _case("LfuMachine", strategy="lfu", given_scores="sometimes", score_values=LFU_SCORES)
TestNoEvictionGrowing = _case("NoEvictionGrowingMachine", strategy="no_eviction", given_scores="never", capacity=16, init_capacity=4)
TestCustomizedGrowing = _case("CustomizedGrowingMachine", strategy="customized", capacity=16, init_capacity=4, max_load_factor=0.5)
TestStepGrowing = _case("StepGrowingMachine", strategy="step", given_scores="never", capacity=16, init_capacity=4)
TestLfuWide = _case("LfuWideMachine", strategy="lfu", given_scores="never", capacity=32, init_capacity=8, bucket_capacity=8)
