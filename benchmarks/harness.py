"""Shared benchmark plumbing: environment, records, timing statistics, summary table.

A record is one contender of one case of one workload, measured over R repeats; rates are the
per-repeat values (steps/s or keys/s), summarised as median / min / max.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import dynemb

REPO = Path(__file__).resolve().parent.parent


def _git(cwd: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _allocator() -> str:
    if os.environ.get("LD_PRELOAD"):
        return f"LD_PRELOAD={os.environ['LD_PRELOAD']}"
    if os.environ.get("GLIBC_TUNABLES"):
        return f"glibc malloc, GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}"
    return "glibc malloc (default settings)"


def environment() -> dict:
    """The code measured (the checkout dynemb is imported from) and the machine."""
    package = Path(dynemb.__file__).resolve().parent
    commit = _git(package, "rev-parse", "--short", "HEAD") or "unknown"
    status = _git(package, "status", "--porcelain", "--", ".")
    return {
        "commit": commit,
        # Uncommitted edits to the package mean the commit alone does not identify the code measured.
        "src_dirty": None if status is None else bool(status),
        "dynemb_path": str(package),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        # Allocators change CPU figures a lot (see DESIGN.md); all contenders share this one.
        "allocator": _allocator(),
    }


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(all processes' busy CPU seconds, elapsed CPU seconds over all cores, this process's CPU
    seconds), from /proc/stat and os.times()."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    own = os.times()
    return (sum(fields) - idle) / tick, sum(fields) / tick, own.user + own.system


class OthersLoad:
    """Share of the machine's CPU time used by *other* processes between start and ``share()``.
    On 2 cores a busy neighbour stalls torch's OpenMP threads and inflates times many-fold."""

    def __init__(self):
        self.start = _cpu_seconds()

    def share(self) -> float | None:
        end = _cpu_seconds()
        if self.start is None or end is None or end[1] <= self.start[1]:
            return None
        busy, total, own = (e - s for e, s in zip(end, self.start))
        return max(0.0, busy - own) / total


def others_load_now(seconds: float = 1.0) -> float | None:
    """Share of CPU time used by other processes over ``seconds`` while this one sleeps."""
    load = OthersLoad()
    time.sleep(seconds)
    return load.share()


# A repeat during which other processes used more than NOISY of the CPU time is discarded and
# retried; before a retry we wait (up to QUIET_WAIT_S) for their share to drop below QUIET.
NOISY = 0.05
QUIET = 0.03
QUIET_WAIT_S = 120.0


def wait_quiet(timeout: float) -> float | None:
    """Wait up to ``timeout`` seconds for other processes to use less than QUIET of the CPUs;
    returns their last measured share."""
    deadline = time.monotonic() + timeout
    share = others_load_now(1.0)
    while share is not None and share > QUIET and time.monotonic() < deadline:
        share = others_load_now(3.0)
    return share


def quiet_repeats(run_repeat: Callable[[int], tuple[dict, list]], repeats: int, max_retries: int, log=print) -> tuple[list[dict], dict]:
    """Call ``run_repeat(attempt)`` until ``repeats`` attempts ran on a quiet machine.

    ``run_repeat`` returns its result and the share of CPU time other processes used during each
    timed block of it (see :func:`OthersLoad`). An attempt with any block above NOISY is
    discarded, at most ``max_retries`` times; after that, noisy attempts are kept (and reported).
    Returns the kept results and {"others_cpu_share": worst block per kept attempt, "discarded"}.
    """
    kept, shares, discarded, attempt = [], [], 0, 0
    while len(kept) < repeats:
        result, block_shares = run_repeat(attempt)
        attempt += 1
        known = [x for x in block_shares if x is not None]
        share = max(known) if known else None
        if share is not None and share > NOISY and discarded < max_retries:
            discarded += 1
            log(f"  discarded: other processes used {share:.0%} of the CPUs during a timed block; waiting for quiet")
            wait_quiet(QUIET_WAIT_S)
            continue
        kept.append(result)
        shares.append(share)
    return kept, {"others_cpu_share": shares, "discarded": discarded}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def stats(values: Sequence[float]) -> dict:
    """median / min / max of per-repeat values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes (CPU ops are synchronous, so wall time is the cost)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def settle() -> None:
    """Collect garbage outside the timed region so a collection does not land inside it."""
    gc.collect()


def time_step_by_step(order: Sequence[tuple[str, Callable, Sequence]], lo: int, hi: int) -> tuple[dict[str, float], float | None]:
    """Seconds each contender's steps took on batches ``lo`` .. ``hi - 1`` of its inputs, run step
    by step in turn (batch i for each contender in ``order``, then batch i + 1), and other
    processes' CPU share meanwhile. ``order``: (name, step, inputs) with ``step(inputs[i])``.

    Interleaving pairs the contenders over the same seconds: on a shared 2-core machine the
    speed drifts between seconds, and blocks of steps per contender turned that drift into the
    paired ratios' spread (perf-log: W3 2026-11-23, W1 2026-11-27 eleventh session)."""
    elapsed = {name: 0.0 for name, _, _ in order}
    settle()
    load = OthersLoad()
    for i in range(lo, hi):
        for name, step, inputs in order:
            t0 = time.perf_counter()
            step(inputs[i])
            elapsed[name] += time.perf_counter() - t0
    return elapsed, load.share()


def record(
    *,
    workload: str,
    case: str,
    contender: str,
    unit: str,
    values: Sequence[float],
    env: dict,
    device: str = "cpu",
    ratio: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """One JSON-lines record. ``values`` are per-repeat figures in ``unit``; ``ratio`` holds
    ``{"vs": reference contender, "median", "min", "max"}`` of the per-repeat paired ratios."""
    rec = {
        "timestamp": now_iso(),
        "workload": workload,
        "case": case,
        "contender": contender,
        "device": device,
        "commit": env["commit"],
        "src_dirty": env["src_dirty"],
        "unit": unit,
        **stats(values),
        "values": list(values),
        "ratio": ratio,
        "env": env,
    }
    if extra:
        rec["extra"] = extra
    return rec


def paired_ratio(contender: Sequence[float], reference: Sequence[float], vs: str) -> dict:
    """Ratios contender / reference of rates measured side by side in each repeat."""
    ratios = [c / r for c, r in zip(contender, reference, strict=True)]
    return {"vs": vs, **stats(ratios), "values": ratios}


def append_jsonl(path: Path, records: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=True) + "\n")


def _fmt(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def summary_rows(records: Sequence[dict]) -> list[list[str]]:
    """Table rows: workload, case, contender, unit, median, min, max, ratio (median [min, max]);
    a record's further ratios (``extra["ratios"]`` besides its ``ratio``) follow in the same cell."""
    rows = []
    for r in records:
        if r.get("unit") == "s/step":
            continue
        ratio = r.get("ratio")
        more = [x for vs, x in r.get("extra", {}).get("ratios", {}).items() if ratio and vs != ratio["vs"]]
        ratio_s = "; ".join(f"{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}] vs {x['vs']}" for x in ([ratio] if ratio else []) + more)
        rows.append(
            [
                r["workload"],
                r["case"],
                r["contender"],
                r["unit"],
                _fmt(r["median"]),
                _fmt(r["min"]),
                _fmt(r["max"]),
                ratio_s,
            ]
        )
    return rows


SUMMARY_HEADER = ["workload", "case", "contender", "unit", "median", "min", "max", "ratio median [min, max]"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)
