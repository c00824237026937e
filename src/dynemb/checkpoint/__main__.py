"""Command-line tools for checkpoints (docs/format.md).

    python -m dynemb.checkpoint inspect PATH [--json]   # tables, rows, dims, optimizer, steps, delta chain
    python -m dynemb.checkpoint verify PATH             # every file of the chain against its manifest; rows and tombstones of each

Exit status: 0 when all is well, 1 when the checkpoint is not (a :class:`dynemb.CheckpointError`,
printed on stderr), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dynemb.checkpoint import files as _files
from dynemb.checkpoint.chain import chain_of
from dynemb.checkpoint.tables import DTYPES
from dynemb.errors import CheckpointError

_COUNTERS = ("step", "optimizer_step", "last_timestamp", "erased", "nonfinite_grads")


def _summary(chain: list[tuple[Path, dict]]) -> dict:
    """What ``inspect`` prints, as JSON-able values: the last checkpoint of ``chain`` and the chain."""
    directory, manifest = chain[-1]
    tables = {}
    for name, t in manifest["tables"].items():
        roles = [f["role"] for f in t["files"]]
        tables[name] = {
            "kind": t.get("kind"),
            "module": t.get("module"),
            "table": t.get("table"),
            "rows": t["rows"],
            "tombstones": t["tombstones"],
            "embedding_dim": t["embedding_dim"],
            "state_dim": t["state_dim"],
            "dtype": t["dtype"],
            "optimizer": t.get("optimizer"),
            "counters": t["counters"],
            "admission": "admission" in roles,
            "layout": "layout" in roles,
            "files": len(t["files"]),
            "bytes": sum(f["bytes"] for f in t["files"]),
        }
    return {
        "path": str(directory),
        "kind": manifest["kind"],
        "id": manifest["id"],
        "format_version": manifest["format_version"],
        "dynemb_version": manifest.get("dynemb_version"),
        "created": manifest.get("created"),
        "dense": manifest.get("dense") is not None,
        "chain": [
            {
                "kind": m["kind"],
                "id": m["id"],
                "path": str(d),
                "rows": sum(t["rows"] for t in m["tables"].values()),
                "tombstones": sum(t["tombstones"] for t in m["tables"].values()),
            }
            for d, m in chain
        ],
        "tables": tables,
    }


def _print_chain(chain: list[dict]) -> None:
    for c in chain:
        print(f"  {c['kind']:<5} {c['id']}  rows {c['rows']}, tombstones {c['tombstones']}  {c['path']}")


def _print_summary(s: dict) -> None:
    print(f"{s['path']}: {s['kind']} checkpoint {s['id']} (format {s['format_version']}, dynemb {s['dynemb_version']}, created {s['created']})")
    print(f"delta chain ({len(s['chain'])}, full first):")
    _print_chain(s["chain"])
    print(f"tables ({len(s['tables'])}):" + ("  + dense state" if s["dense"] else ""))
    for name, t in s["tables"].items():
        where = f"table {t['table']!r} of the collection at {t['module']!r}" if t["kind"] == "collection" else f"DynamicTable at {t['module']!r}"
        print(f"  {name}: {where}")
        print(f"    rows {t['rows']}, tombstones {t['tombstones']}, embedding_dim {t['embedding_dim']}, state_dim {t['state_dim']}, dtype {t['dtype']}")
        opt = t["optimizer"]
        if opt is None:
            print("    optimizer: none (frozen)")
        else:
            hyper = ", ".join(f"{k}={v}" for k, v in opt["hyper_parameters"].items())
            print(f"    optimizer: {opt['type']}({hyper})")
        counters = t["counters"]
        print("    " + ", ".join(f"{k} {counters[k]}" for k in _COUNTERS if k in counters))
        extras = [x for x in ("admission", "layout") if t[x]]
        print(f"    files {t['files']} ({t['bytes']} bytes)" + (f", with {' and '.join(extras)}" if extras else ""))


def _check_contents(directory: Path, manifest: dict) -> tuple[int, int]:
    """The tensors of every file: names, dtypes and shapes as the manifest says, keys unique per
    table. One file in memory at a time; returns the rows checked and how many of them hold NaN
    or inf (not an error: load reads them with a warning, docs/design/0020-nonfinite-rows.md)."""
    total, nonfinite = 0, 0
    for name, t in manifest["tables"].items():
        D, S, dtype = t["embedding_dim"], t["state_dim"], DTYPES[t["dtype"]]
        seen = {"rows": [], "tombstones": []}
        for f in t["files"]:
            role, n = f["role"], f.get("rows")
            if role == "rows":
                spec = {"keys": (torch.int64, (n,)), "embeddings": (dtype, (n, D)), "optimizer_state": (dtype, (n, S)), "scores": (torch.int64, (n,))}
            elif role == "tombstones":
                spec = {"keys": (torch.int64, (n,))}
            elif role == "generator":
                spec = {"state": (torch.uint8, (None,))}
            else:
                # admission and layout: index states, checked by their loaders.
                continue
            tensors = _files.read_tensors(directory, f, spec)
            if role == "rows":
                finite = torch.isfinite(tensors["embeddings"]).all(1) & torch.isfinite(tensors["optimizer_state"]).all(1)
                nonfinite += int((~finite).sum())
                total += n
            if role in seen:
                seen[role].append(tensors["keys"])
        for role, keys in seen.items():
            k = torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64)
            if torch.unique(k).numel() != k.numel():
                raise CheckpointError(f"table {name!r}: a key appears twice in its {role} files", directory)
    return total, nonfinite


def _inspect(path: str, as_json: bool) -> int:
    summary = _summary(chain_of(path))
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary)
    return 0


def _verify(path: str) -> int:
    chain = chain_of(path)
    files, size, rows, nonfinite = 0, 0, 0, 0
    for directory, manifest in chain:
        _files.verify_files(directory, manifest)
        checked, bad = _check_contents(directory, manifest)
        rows, nonfinite = rows + checked, nonfinite + bad
        entries = [f for t in manifest["tables"].values() for f in t["files"]] + ([manifest["dense"]] if manifest.get("dense") else [])
        files += len(entries) + 2
        size += sum(f["bytes"] for f in entries)
    note = f" ({nonfinite} of them hold NaN or inf: load reads them as they are, with a warning)" if nonfinite else ""
    print(f"OK {chain[-1][0]}: {len(chain)} checkpoint(s), {files} files, {size} bytes, {rows} rows{note}")
    # What each checkpoint of the chain holds: an empty delta stands out.
    _print_chain(_summary(chain)["chain"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynemb.checkpoint", description="Inspect or verify a dynemb checkpoint (docs/format.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("inspect", help="tables, rows, dims, dtype, optimizer, step counters and the delta chain")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p = commands.add_parser("verify", help="check every file of the chain (size, SHA-256, tensors) against its manifest")
    p.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args.path, args.json)
        return _verify(args.path)
    except CheckpointError as e:
        print(f"CheckpointError: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
