"""Where the time of a dynemb train step goes: wall-clock timers around its internal phases.

N ids in a batch, D embedding dim.

The timers are installed on one table *instance* (instance attributes shadow its methods and
those of its engine, index, free list, store, initializer and optimizer); dynemb's source is
not touched. CPU ops
are synchronous, so a phase's wall time is its cost. Phases nest; each is reported with its
exclusive time (its own time minus that of the phases inside it), so exclusive times add up to
the step. Timer overhead is a few microseconds per call, ~1e-4 of a step.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Nested wall-clock phases, named by path (``step/forward/lookup``)."""

    def __init__(self):
        self._stack: list[list] = []  # [path, seconds spent in child phases]
        self.exclusive: dict[str, float] = defaultdict(float)
        self.inclusive: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        path = f"{self._stack[-1][0]}/{name}" if self._stack else name
        # Register on entry, so that phases are listed parents first, in call order.
        self.exclusive[path] += 0.0
        self.inclusive[path] += 0.0
        self._stack.append([path, 0.0])
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            _, children = self._stack.pop()
            self.inclusive[path] += dt
            self.exclusive[path] += dt - children
            if self._stack:
                self._stack[-1][1] += dt

    def wrap(self, obj: object, attr: str, name: str) -> None:
        """Time every call of ``obj.attr`` (a bound method or callable attribute) as ``name``."""
        fn = getattr(obj, attr)

        def timed_call(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        setattr(obj, attr, timed_call)

    def reset(self) -> None:
        self.exclusive.clear()
        self.inclusive.clear()


# (owner, attribute, phase name). Names differ between versions of dynemb (before the engine
# split of issue 7 the table did the work itself: ``_gather_batch``, ``_upsert``, ...); those a
# version lacks are skipped, and their time shows up in the calling phase, so one list profiles
# old and new checkouts alike. Since the split a train step nests as
#   lookup (table._gather) > resolve (engine.resolve) > index.upsert_unique > index._locate, ...
#   apply_lookup_gradients (own time: the per-key gradient sum) > apply_gradients (engine)
_PHASES = (
    ("table", "_gather", "lookup"),
    ("table", "_gather_batch", "lookup"),
    ("engine", "resolve", "resolve"),
    ("table", "_upsert", "upsert"),
    ("index", "upsert_unique", "index.upsert_unique"),
    ("index", "_locate", "index._locate"),
    ("index", "_place_free", "index._place_free"),
    ("index", "_fill", "index._fill"),
    ("index", "_make_room", "index._make_room"),
    ("index", "_move_out", "index._move_out"),
    ("index", "_displace", "index._displace"),
    ("index", "_evict_for", "index._evict_for"),
    ("index", "_grow", "index._grow"),
    ("free_list", "allocate", "free_list.allocate"),
    ("engine", "new_rows", "new_rows"),
    ("table", "_new_rows", "new_rows"),
    ("engine", "initializer", "initializer"),
    ("table", "initializer", "initializer"),
    ("store", "reserve", "store.reserve"),
    ("store", "allocate", "store.allocate"),
    ("store", "gather", "store.gather"),
    ("store", "scatter", "store.scatter"),
    ("table", "_apply_lookup_gradients", "apply_lookup_gradients"),
    ("table", "_sum_per_key", "sum_per_key"),
    ("engine", "apply_gradients", "apply_gradients"),
    ("table", "_apply_gradients", "apply_gradients"),
    ("optimizer", "update", "optimizer.update"),
)


def instrument(table: torch.nn.Module, timer: PhaseTimer) -> list[str]:
    """Install timers on the phases of ``table``'s forward (lookup) and backward (fused update).

    Returns:
        the phases this version of dynemb has no method for under any known name (not timed
        separately), each with the first name tried.
    """
    index = table.index
    owners = {
        "table": table,
        "engine": getattr(table, "engine", None),
        "index": index,
        "free_list": getattr(index, "free_list", None),
        "store": table.store,
        "optimizer": table.optimizer,
    }
    timed, absent = set(), {}
    for owner, attr, name in _PHASES:
        obj = owners[owner]
        # A property (e.g. the engine's ``initializer`` since the one-engine work) cannot be wrapped.
        if obj is not None and hasattr(obj, attr) and not isinstance(getattr(type(obj), attr, None), property):
            timer.wrap(obj, attr, name)
            timed.add(name)
        else:
            absent.setdefault(name, f"{owner}.{attr}")
    return [f"{name} ({where})" for name, where in absent.items() if name not in timed]


def profile_steps(step: Callable[[torch.Tensor, PhaseTimer], None], batches: Iterable[torch.Tensor], timer: PhaseTimer) -> dict[str, list[float]]:
    """Run ``step(batch, timer)`` per batch; exclusive seconds of each phase path, one per step."""
    per_step: dict[str, list[float]] = defaultdict(list)
    n = 0
    for batch in batches:
        timer.reset()
        step(batch, timer)
        for path, seconds in timer.exclusive.items():
            per_step[path].append(seconds)
        n += 1
    # A phase absent from a step (e.g. no new keys) took 0 s in it.
    return {path: values + [0.0] * (n - len(values)) for path, values in per_step.items()}


def phase_table(per_step: dict[str, list[float]]) -> list[tuple[str, float, float]]:
    """(path, median exclusive seconds per step, share of the sum of medians), parents first."""
    medians = {path: statistics.median(values) for path, values in per_step.items()}
    total = sum(medians.values())
    return [(path, med, med / total if total else 0.0) for path, med in medians.items()]


def top_ops(step: Callable[[torch.Tensor], None], batches: Iterable[torch.Tensor], limit: int = 12) -> str:
    """torch.profiler's table of the ops with the most self CPU time over ``batches``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            step(batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=limit)
