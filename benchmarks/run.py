"""dynemb benchmarks: one entry point for the named workloads.

    python benchmarks/run.py                     # W1, W1-evict, W2 and W3, full size (~12 min on 2 CPU cores)
    python benchmarks/run.py --quick             # smoke run (< 1 min)
    python benchmarks/run.py --workload W1 --steps 10 --repeats 3

W1  train step, Zipf(1.05) int64 ids, D=128: dynemb vs torch.nn.Embedding(sparse=True), and vs the
    floor (a static tensor on the same remapped ids with a hand-fused update), steps/s.
W1-evict  the same with the dynemb table at 1/4 of the stream's keys: full, evicting every step.
    Also vs TorchRec's ManagedCollisionEmbeddingCollection (LFU MCH, eviction every step, same capacity).
W2  KeyIndex find / find_or_insert at load 0.5 and 0.9 vs a Python dict (and a sorted array), keys/s.
W3  train step of 26 Criteo-like features, batch 4,096, row-wise Adagrad: DynamicEmbeddingBagCollection
    vs a Python loop over 26 DynamicEmbeddingBag vs FBGEMM's TBE (TorchRec's fused EBC kernel), steps/s.

Every contender is measured against its reference in the same process and repeat; records are
appended as JSON lines to --out and summarised as a table (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import torch

import harness
import w1_train_step

DEFAULT_OUT = harness.REPO / "benchmarks" / "results" / "results.jsonl"
DOCS = harness.REPO / "docs" / "benchmarks.md"
# Allocators to run under (DESIGN.md: the allocator changes CPU train steps by up to 2.4x). The
# process re-executes itself with the setting, so every contender of a run shares it.
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
)
# glibc keeping freed memory: never mmap (a fresh mmap of a 32 MiB [65536, 128] fp32 tensor
# page-faults on every step), never trim the heap.
GLIBC_KEEP = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
# Each allocator's latest figures live between their own markers in docs/benchmarks.md.
DOCS_MARKERS = "<!-- results{tag}:begin -->", "<!-- results{tag}:end -->"

# (steps, repeats) per workload; W1 also warms up and profiles a few steps.
FULL = {"W1": (20, 7), "W1-evict": (20, 7), "W2": (30, 5), "W3": (20, 7)}
QUICK = {"W1": (3, 2), "W1-evict": (3, 2), "W2": (5, 2), "W3": (3, 2)}
DEFAULT_MAX_RETRIES = 3


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("W1", "W1-evict", "W2", "W3", "all"), default="all")
    p.add_argument("--steps", type=int, help="timed steps (W1, W3) or calls (W2) per repeat and contender")
    p.add_argument("--repeats", type=int, help="repeats; each times every contender once")
    p.add_argument("--quick", action="store_true", help="few steps and repeats: a smoke run")
    p.add_argument("--no-profile", action="store_true", help="skip the phase profiles of the dynemb steps (W1, W3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--allocator",
        choices=("default", "jemalloc", "glibc-keep"),
        default="default",
        help="run under jemalloc (LD_PRELOAD) or glibc tuned to keep freed memory; default: as started",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON lines file results are appended to")
    p.add_argument(
        "--max-retries",
        type=int,
        help=f"noisy repeats (others > 5%% of CPUs) to redo; default: min(--repeats, {DEFAULT_MAX_RETRIES})",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="SECONDS",
        help="first wait up to SECONDS for other processes to leave the CPUs idle",
    )
    p.add_argument("--update-docs", action="store_true", help=f"rewrite the results section of {DOCS.relative_to(harness.REPO)}")
    args = p.parse_args(argv)
    for name, least in (("steps", 1), ("repeats", 1), ("max_retries", 0)):
        value = getattr(args, name)
        if value is not None and value < least:
            p.error(f"--{name.replace('_', '-')}={value}: must be >= {least}")
    return args


def _sizes(args: argparse.Namespace, workload: str) -> tuple[int, int]:
    steps, repeats = (QUICK if args.quick else FULL)[workload]
    return args.steps or steps, args.repeats or repeats


def _max_retries(args: argparse.Namespace, repeats: int) -> int:
    """Noisy repeats that may be discarded and redone (each W1 retry also moves the table on by
    ``steps`` batches of the stream, so the default is small)."""
    return min(repeats, DEFAULT_MAX_RETRIES) if args.max_retries is None else args.max_retries


def _noise_line(records: list[dict]) -> str:
    """How much other processes used the CPUs during the repeats kept, and how many were redone."""
    shares, discarded = [], 0
    for r in records:
        extra = r.get("extra", {})
        if r.get("ratio") and "others_cpu_share" in extra:
            shares += [s for s in extra["others_cpu_share"] if s is not None]
            discarded += extra["discarded"]
    if not shares:
        return "Other processes' CPU use during the repeats: not measured"
    return (
        f"Other processes used at most {max(shares):.1%} of the CPU time during any kept repeat "
        f"(threshold {harness.NOISY:.0%}); {discarded} noisy repeat(s) discarded and redone"
    )


def _docs_section(records: list[dict], env: dict, command: str, seconds: float) -> str:
    header = harness.SUMMARY_HEADER
    lines = [
        f"Command: `{command}`  ",
        f"Date: {records[0]['timestamp'] if records else harness.now_iso()} (UTC), wall time {seconds:.0f} s  ",
        f"Commit: `{env['commit']}`" + (" with uncommitted changes" if env["src_dirty"] else "") + "  ",
        (
            f"Machine: {env['cpus']} CPU cores ({env['cpu_model']}), torch {env['torch']} with {env['threads']} "
            f"threads, allocator {env['allocator']}, Python {env['python']}  "
        ),
        _noise_line(records),
        "",
        harness.markdown_table(header, harness.summary_rows(records)),
    ]
    for workload in ("W1", "W1-evict"):
        lines += _w1_lines(workload, records)
    lines += _w3_lines(records)
    return "\n".join(lines)


def _w3_lines(records: list[dict]) -> list[str]:
    """W3: the second ratio (collection / TBE), keys and tables, parity, then the phase profile."""
    w3 = [r for r in records if r["workload"] == "W3" and r["extra"].get("ratios")]
    if not w3:
        return []
    r = w3[0]
    e = r["extra"]
    tbe = next(x for vs, x in e["ratios"].items() if vs != r["ratio"]["vs"])
    p, s = e["parity_max_abs_diff"], e["stats"]
    lines = [
        "",
        (
            f"W3: {e['features']} features x {e['batch']} samples = {e['ids_per_step']} ids per step, "
            f"{e['unique_keys_per_step']:.0f} distinct (feature, key) pairs per timed step; the TBE holds "
            f"{sum(e['num_keys'])} rows (every key of the pre-generated stream). Collection / {tbe['vs']}: "
            f"{tbe['median']:.2f} [{tbe['min']:.2f}, {tbe['max']:.2f}]. Collection tables after the timed steps: "
            f"size {s['size']}, inserts {s['inserts']}, evictions {s['evictions']}, failed inserts {s['failed_inserts']}. "
            f"Parity max abs diff: collection vs loop outputs {p['loop_outputs']:.1e}, rows {p['loop_rows']:.1e}; "
            f"collection vs TBE rows {p['tbe_rows']:.1e}."
        ),
    ]
    prof = [x for x in records if x["workload"] == "W3-profile"]
    if prof:
        others = max((x["extra"].get("others_cpu_share") or 0.0) for x in prof)
        lines += [
            "",
            f"W3 collection step, exclusive wall time per phase, median over the profiled steps (others used at most {others:.0%} of the CPUs):",
            "",
        ]
        phases = [x["contender"].removeprefix("collection:") for x in prof]
        rows = [
            [
                "· " * path.count("/") + path.rsplit("/", 1)[-1] + (" (own)" if any(q.startswith(path + "/") for q in phases) else ""),
                f"{x['median'] * 1e3:.1f} ({x['extra']['share']:.0%})",
            ]
            for path, x in zip(phases, prof)
        ]
        rows.append(["**sum**", f"{sum(x['median'] for x in prof) * 1e3:.1f}"])
        lines.append(harness.markdown_table(["phase", "ms (share)"], rows))
    return lines


def _w1_lines(workload: str, records: list[dict]) -> list[str]:
    """W1 / W1-evict: stream and table figures per case, then the phase profile's table."""
    lines = []
    w1 = [r for r in records if r["workload"] == workload and r["contender"] == "dynemb"]
    if w1:
        e = w1[0]["extra"]
        fill = (
            f" The dynemb table holds {e['capacity']} keys (1/4 of them); it (and the MCH contender, at the same capacity) trained on the first "
            f"{e['fill_steps']} batches, which brought that many keys, before the warm-up."
            if e.get("fill_steps")
            else ""
        )
        lines += [
            "",
            (
                f"{workload}: {e['ids_per_step']} ids per step; the reference table has "
                f"{e['reference_rows']} rows (every key of the pre-generated stream).{fill}"
            ),
        ]
        for r in w1:
            e, s = r["extra"], r["extra"]["stats"]
            per_step = e.get("table_per_step")
            timed = (
                f"; per timed step the table inserted {per_step['inserts']:.0f}, evicted {per_step['evictions']:.0f} "
                f"and failed {per_step['failed_inserts']:.0f} keys"
                if per_step
                else ""
            )
            lines.append(
                f"dynemb {r['case']}: timed steps had {e['unique_keys_per_step']:.0f} unique / "
                f"{e['new_keys_per_step']:.0f} new keys per step{timed}; "
                f"table after them: size {s['size']}, load factor {s['load_factor']:.3f}, inserts {s['inserts']}, "
                f"evictions {s['evictions']}, failed inserts {s['failed_inserts']}; "
                f"parity max abs diff {e['parity_max_abs_diff']:.1e}"
                + (f", floor vs reference {e['floor_parity_max_abs_diff']:.1e}" if "floor_parity_max_abs_diff" in e else "")
                + "."
            )
        for r in (x for x in records if x["workload"] == workload and "mch_per_step" in x.get("extra", {})):
            m, c = r["extra"]["mch_per_step"], r["extra"]["mch_counters"]
            lines.append(
                f"{r['contender']} {r['case']}: per timed step {m['evictions']:.0f} rows evicted and {m['missed_ids']:.0f} ids "
                f"mapped to the shared miss row; open slots after them {c['open_slots']}; "
                f"parity max abs diff vs reference {r['extra']['parity_max_abs_diff_vs_reference']:.1e}."
            )
    prof = [r for r in records if r["workload"] == f"{workload}-profile"]
    if prof:
        cases = list(dict.fromkeys(r["case"] for r in prof))
        by_phase: dict[str, dict[str, dict]] = {}
        for r in prof:
            by_phase.setdefault(r["contender"].removeprefix("dynemb:"), {})[r["case"]] = r
        others = max((r["extra"].get("others_cpu_share") or 0.0) for r in prof)
        lines += [
            "",
            (
                f"{workload} dynemb step, exclusive wall time per phase, median over the profiled steps (others used at "
                f"most {others:.0%} of the CPUs); a phase's own time excludes the phases nested in it, so the "
                "column adds up to the step:"
            ),
            "",
        ]
        header = ["phase"] + [f"{c}: ms (share)" for c in cases]
        rows = []
        for phase, per_case in by_phase.items():
            depth = phase.count("/")
            name = "· " * depth + phase.rsplit("/", 1)[-1] + (" (own)" if any(p.startswith(phase + "/") for p in by_phase) else "")
            cells = [f"{per_case[c]['median'] * 1e3:.1f} ({per_case[c]['extra']['share']:.0%})" if c in per_case else "" for c in cases]
            rows.append([name] + cells)
        totals = [f"{sum(per_case[c]['median'] for per_case in by_phase.values() if c in per_case) * 1e3:.1f}" for c in cases]
        rows.append(["**sum**"] + totals)
        lines.append(harness.markdown_table(header, rows))
    return lines


def update_docs(section: str, allocator: str) -> None:
    """Replace the figures between this allocator's markers (appending them if absent)."""
    tag = "" if allocator == "default" else f"-{allocator}"
    begin_mark, end_mark = (m.format(tag=tag) for m in DOCS_MARKERS)
    text = DOCS.read_text()
    if begin_mark not in text:
        text = text.rstrip("\n") + f"\n\n### Under `--allocator {allocator}`\n\n{begin_mark}\n{end_mark}\n"
    begin, end = text.index(begin_mark) + len(begin_mark), text.index(end_mark)
    DOCS.write_text(text[:begin] + "\n" + section + "\n" + text[end:])


def _reexec_with_allocator(choice: str) -> None:
    """Restart this process under the chosen allocator, once (the marker stops a loop)."""
    if choice == "default" or os.environ.get("DYNEMB_BENCH_ALLOCATOR") == choice:
        return
    env = dict(os.environ, DYNEMB_BENCH_ALLOCATOR=choice)
    if choice == "jemalloc":
        path = next((p for p in JEMALLOC_PATHS if os.path.exists(p)), None)
        if path is None:
            sys.exit(f"--allocator jemalloc: libjemalloc.so.2 not found in {JEMALLOC_PATHS} (apt-get install libjemalloc2)")
        env["LD_PRELOAD"] = path
    else:
        env["GLIBC_TUNABLES"] = GLIBC_KEEP
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    _reexec_with_allocator(args.allocator)
    torch.manual_seed(args.seed)
    env = harness.environment()
    command = "python benchmarks/run.py" + ("" if not argv else " " + shlex.join(argv))
    if not Path(env["dynemb_path"]).is_relative_to(harness.REPO / "src"):
        command = f"PYTHONPATH={Path(env['dynemb_path']).parent} {command}"
    print(
        f"dynemb from {env['dynemb_path']} at {env['commit']}{' (modified)' if env['src_dirty'] else ''}: "
        f"torch {env['torch']}, {env['threads']} threads, {env['cpu_model']}"
    )
    before = harness.wait_quiet(args.wait_quiet)
    if before is not None and before > harness.NOISY:
        print(f"warning: other processes use {before:.0%} of the CPUs; figures will be noisy", file=sys.stderr)
    load = harness.OthersLoad()
    t0 = time.perf_counter()
    records: list[dict] = []
    for workload, fraction in (("W1", None), ("W1-evict", w1_train_step.EVICT_CAPACITY_FRACTION)):
        if args.workload not in (workload, "all"):
            continue
        steps, repeats = _sizes(args, workload)
        cfg = w1_train_step.W1Config(
            steps=steps,
            repeats=repeats,
            warmup=2 if args.quick else 5,
            profile_steps=0 if args.no_profile else (2 if args.quick else 5),
            max_retries=_max_retries(args, repeats),
            seed=args.seed,
            capacity_fraction=fraction,
        )
        records += w1_train_step.run(cfg, env)
    if args.workload in ("W2", "all"):
        import w2_index  # imported here: it needs KeyIndex APIs that older checkouts measured by W1 lack

        steps, repeats = _sizes(args, "W2")
        records += w2_index.run(
            w2_index.W2Config(steps=steps, repeats=repeats, max_retries=_max_retries(args, repeats), seed=args.seed),
            env,
        )
    if args.workload in ("W3", "all"):
        import w3_collection  # imported here: it needs the collection API and torchrec / fbgemm_gpu

        steps, repeats = _sizes(args, "W3")
        records += w3_collection.run(
            w3_collection.W3Config(
                steps=steps,
                repeats=repeats,
                warmup=2 if args.quick else 5,
                profile_steps=0 if args.no_profile else (2 if args.quick else 5),
                max_retries=_max_retries(args, repeats),
                seed=args.seed,
            ),
            env,
        )
    seconds = time.perf_counter() - t0
    # Whole run, waits for quiet included; the per-repeat shares are in each record's extra.
    env["others_cpu_share_whole_run"] = load.share()
    print(_noise_line(records))
    for rec in records:
        rec["command"] = command
        rec["quick"] = args.quick
    harness.append_jsonl(args.out, records)
    print()
    print(harness.text_table(harness.SUMMARY_HEADER, harness.summary_rows(records)))
    print(f"\n{len(records)} records appended to {args.out} ({seconds:.0f} s)")
    if args.update_docs:
        update_docs(_docs_section(records, env, command, seconds), args.allocator)
        print(f"updated {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
