"""Reading: a checkpoint's chain of manifests (a delta and its bases) and one table's rows through it.

K keys of a table, D embedding dim, S optimizer state columns.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from dynemb.checkpoint import files as _files
from dynemb.checkpoint.tables import DTYPES
from dynemb.errors import CheckpointError
from dynemb.nn.functional import warn_nonfinite


def chain_of(path) -> list[tuple[Path, dict]]:
    """(directory, manifest) of the full checkpoint and every delta up to ``path``, in order."""
    directory = _files.resolve_dir(path)
    manifest = _files.read_manifest(directory)
    chain = [(directory, manifest)]
    while manifest["kind"] == "delta":
        base = manifest.get("base")
        if not isinstance(base, dict) or not isinstance(base.get("path"), str) or not isinstance(base.get("id"), str):
            raise CheckpointError("delta manifest has no valid 'base' {id, path}", directory / _files.MANIFEST)
        base_dir = _files.resolve_dir((directory.parent / base["path"]).resolve())
        base_manifest = _files.read_manifest(base_dir)
        if base_manifest["id"] != base["id"]:
            raise CheckpointError(f"its base at {base_dir} has id {base_manifest['id']}, the delta expects {base['id']}", directory / _files.MANIFEST)
        if len(chain) > 10_000:
            raise CheckpointError("delta chain longer than 10000 (a cycle?)", directory)
        directory, manifest = base_dir, base_manifest
        chain.append((directory, manifest))
    chain.reverse()
    names = set(chain[0][1]["tables"])
    for d, m in chain[1:]:
        if set(m["tables"]) != names:
            raise CheckpointError(f"delta lists tables {sorted(m['tables'])}, its full checkpoint {sorted(names)}", d / _files.MANIFEST)
    return chain


def read_table(chain: list[tuple[Path, dict]], name: str, check_hash: bool = False) -> dict:
    """Merge a table's rows over the chain: keys [K], values [K, D+S], scores [K] (in file order).

    The full checkpoint's rows are read into one preallocated block, file by file, so reading
    needs memory for the table plus one file."""
    first = chain[0][1]["tables"][name]
    D, S, dtype = first["embedding_dim"], first["state_dim"], DTYPES[first["dtype"]]
    keys = torch.empty(0, dtype=torch.int64)
    values = torch.empty(0, D + S, dtype=dtype)
    scores = torch.empty(0, dtype=torch.int64)
    for position, (directory, manifest) in enumerate(chain):
        entry = manifest["tables"][name]
        if (entry["embedding_dim"], entry["state_dim"], entry["dtype"]) != (D, S, first["dtype"]):
            raise CheckpointError(f"table {name!r}: embedding_dim / state_dim / dtype change along the delta chain", directory / _files.MANIFEST)
        new_k, new_v, new_s, tomb = [], [], [], []
        # The full checkpoint's rows go straight into one block (its size is in the manifest).
        block = torch.empty(entry["rows"], D + S, dtype=dtype) if position == 0 else None
        filled = 0
        for f in entry["files"]:
            if f["role"] == "rows":
                n = f["rows"]
                t = _files.read_tensors(
                    directory,
                    f,
                    {"keys": (torch.int64, (n,)), "embeddings": (dtype, (n, D)), "optimizer_state": (dtype, (n, S)), "scores": (torch.int64, (n,))},
                    check_hash=check_hash,
                )
                new_k.append(t["keys"])
                if block is not None:
                    block[filled : filled + n, :D] = t["embeddings"]
                    block[filled : filled + n, D:] = t["optimizer_state"]
                    filled += n
                else:
                    new_v.append(torch.cat([t["embeddings"], t["optimizer_state"]], 1))
                new_s.append(t["scores"])
                del t
            elif f["role"] == "tombstones":
                tomb.append(_files.read_tensors(directory, f, {"keys": (torch.int64, (f["rows"],))})["keys"])
        add_k = torch.cat(new_k) if new_k else keys[:0]
        if torch.unique(add_k).numel() != add_k.numel():
            raise CheckpointError(f"table {name!r}: a key appears twice in its rows files", directory)
        if block is not None:
            keys, values, scores = add_k, block, torch.cat(new_s) if new_s else scores
            continue
        drop = torch.cat([*tomb, add_k]) if tomb else add_k
        if drop.numel() and keys.numel():
            keep = ~torch.isin(keys, drop)
            keys, values, scores = keys[keep], values[keep], scores[keep]
        if new_k:
            keys = torch.cat([keys, add_k])
            values = torch.cat([values, *new_v])
            scores = torch.cat([scores, *new_s])
    # Non-finite rows (written by nonfinite_grads='apply') load as they were saved, with a warning.
    warn_nonfinite(keys, values, f"table {name!r} of {chain[-1][0]}")
    last_dir, last = chain[-1]
    entry = last["tables"][name]
    extra = {}
    for f in entry["files"]:
        if f["role"] == "admission":
            try:
                extra["admission"] = load_file(last_dir / f["path"])
                extra["admission_path"] = last_dir / f["path"]
            except Exception as e:  # safetensors raises several types
                raise CheckpointError(f"not a readable safetensors file ({e})", last_dir / f["path"]) from None
        elif f["role"] == "generator":
            extra["generator"] = _files.read_tensors(last_dir, f, {"state": (torch.uint8, (None,))})["state"]
            extra["generator_path"] = last_dir / f["path"]
        elif f["role"] == "layout" and len(chain) == 1:
            try:
                extra["layout"] = load_file(last_dir / f["path"])
            except Exception as e:
                raise CheckpointError(f"not a readable safetensors file ({e})", last_dir / f["path"]) from None
    if "layout" in extra and not (isinstance(extra["layout"].get("slots"), torch.Tensor) and extra["layout"]["slots"].shape == keys.shape):
        del extra["layout"]
    return {
        "keys": keys,
        "values": values,
        "scores": scores,
        "entry": entry,
        "D": D,
        "S": S,
        **extra,
    }


def counter(entry: dict, name: str, path) -> int:
    v = entry["counters"].get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CheckpointError(f"counter '{name}'={v!r} must be an int >= 0", path)
    return v
