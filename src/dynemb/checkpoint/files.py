"""Files of a checkpoint directory (docs/format.md): manifest, hashed safetensors, atomic commit."""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import glob
import hashlib
import json
import os
import re
import shutil
import struct
import time
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from dynemb.checkpoint import leftovers
from dynemb.errors import CheckpointError

FORMAT = "dynemb-checkpoint"
# One thread hashes while the caller writes (hashlib and file writes release the GIL); another
# fsyncs each finished file, so the disk writes it back while the next one is filled.
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynemb-sha256")
_FLUSHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynemb-fsync")
_PIECE = 1 << 26
_ST_DTYPES = {
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
}  # fmt: skip


def _safetensors_pieces(tensors: dict[str, torch.Tensor]):
    """The bytes of a safetensors file holding ``tensors``, as buffers over the tensors' memory:
    8-byte little-endian header length, the JSON header (padded with spaces to 8 bytes), then
    each tensor's raw little-endian bytes in header order."""
    header, flat, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        flat.append(t.reshape(-1).view(torch.uint8) if n else None)
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    yield struct.pack("<Q", len(head)) + head
    for raw in flat:
        if raw is None:
            continue
        view = memoryview(raw.numpy())
        for start in range(0, len(view), _PIECE):
            yield view[start : start + _PIECE]


FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DENSE = "dense.safetensors"
# ``sha256sum`` line of manifest.json: the manifest's own numbers (counters, steps) are checked too.
MANIFEST_SHA = "manifest.sha256"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def table_dir(name: str) -> str:
    """The directory of a table's files, relative to the checkpoint."""
    return "tables/" + _SAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), name)


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def new_id() -> str:
    return uuid.uuid4().hex


def _fsync(path: Path) -> None:
    """fsync a file or a directory by its path (a descriptor opened for reading)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync(path)


class Writer:
    """Writes a checkpoint into a temporary sibling directory, then commits it by renaming.

    Args:
        path: the checkpoint directory to create.
        overwrite: replace an existing checkpoint at ``path`` (else it is an error).
    """

    def __init__(self, path: str | os.PathLike, overwrite: bool = False, *, tmp: Path | None = None):
        self.path = Path(path)
        self.overwrite = overwrite
        # fsyncs of the files written so far, running behind the writes.
        self._flushing: list[concurrent.futures.Future] = []
        # (manifest entry, future of its hex digest): hashing runs behind the writes.
        self._hashing: list[tuple[dict, concurrent.futures.Future]] = []
        if tmp is not None:
            # A sharded save's other ranks write their files into the directory rank 0 made.
            self.tmp = Path(tmp)
            return
        if self.path.name.startswith("."):
            raise ValueError(f"path={str(path)!r}: a checkpoint's name must not start with '.' (those are temporary or replaced saves)")
        if (self.path.exists() or _aside(self.path)) and not overwrite:
            raise FileExistsError(f"{self.path}: exists; pass overwrite=True to replace it, or save to a new path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Killed saves' directories go first; the new one is named after this process, so that
        # no sweep removes it while this process lives (leftovers.py).
        leftovers.sweep(self.path.parent)
        self.tmp = leftovers.tmp_dir(self.path)
        self.tmp.mkdir()

    def write_tensors(self, relative: str, tensors: dict[str, torch.Tensor], role: str, rows: int | None = None) -> dict:
        """Write one safetensors file; returns its manifest entry (path, role, rows, bytes, sha256).

        The file is streamed from the tensors' memory (no serialised copy) while a second thread
        hashes what was written, so a save costs about one write of the data."""
        target = self.tmp / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        with open(target, "wb") as f:
            for piece in _safetensors_pieces(tensors):
                # The hashing thread keeps the pieces (and so the tensors) alive until hashed.
                _HASHER.submit(digest.update, piece)
                f.write(piece)
                size += len(piece)
        self._flushing.append(_FLUSHER.submit(_fsync, target))
        entry = {"path": relative, "role": role, "bytes": size, "sha256": None}
        self._hashing.append((entry, _HASHER.submit(digest.hexdigest)))
        # At most two files' buffers wait for the hasher: memory stays about one chunk.
        while len(self._hashing) > 2:
            self._settle_hash()
        if rows is not None:
            entry["rows"] = rows
        return entry

    def _settle_hash(self) -> None:
        entry, job = self._hashing.pop(0)
        entry["sha256"] = job.result()

    def wait_hashed(self, entry: dict) -> None:
        """Block until the file of ``entry`` (returned by :meth:`write_tensors`) is hashed: the
        tensors it was written from may then be overwritten."""
        while entry["sha256"] is None and self._hashing:
            self._settle_hash()

    def finish(self) -> None:
        """Wait until every file written is hashed (its entry complete) and fsynced."""
        while self._hashing:
            self._settle_hash()
        while self._flushing:
            self._flushing.pop(0).result()

    def commit(self, manifest: dict) -> None:
        """Write the manifest, fsync everything, and rename the directory into place."""
        self.finish()
        data = json.dumps(manifest, indent=1, sort_keys=False).encode()
        for name, content in ((MANIFEST, data), (MANIFEST_SHA, f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n".encode())):
            with open(self.tmp / name, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
        for folder, _, _ in os.walk(self.tmp):
            _fsync_dir(Path(folder))
        # At most one checkpoint is ever left aside: older ones (from killed saves) go first,
        # while ``path`` still holds the current checkpoint.
        aside = _aside(self.path)
        if self.path.exists():
            for old in aside:
                shutil.rmtree(old, ignore_errors=True)
            aside = [self.path.parent / f".{self.path.name}.old-{time.time_ns():020d}{new_id()[:8]}"]
            os.rename(self.path, aside[0])
        os.rename(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        for old in aside:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        for job in self._hashing:
            job[1].cancel()
        concurrent.futures.wait([job for _, job in self._hashing] + self._flushing)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _aside(path: Path) -> list[Path]:
    """Checkpoints that replacing saves of ``path`` renamed aside (``.<name>.old-<time>...``),
    oldest first."""
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.glob(f".{glob.escape(path.name)}.old-*") if (p / MANIFEST).is_file())


def resolve_dir(path: str | os.PathLike) -> Path:
    """The checkpoint directory at ``path``; if a replacing save was killed between its two
    renames, the previous checkpoint left aside under ``.<name>.old-*`` is used."""
    path = Path(path)
    if path.name.startswith(".") and path.name != "..":
        raise CheckpointError("a name starting with '.' is a temporary or replaced save, not a checkpoint", path)
    if path.is_dir():
        return path
    aside = _aside(path)
    if aside:
        return aside[-1]
    raise CheckpointError("no checkpoint directory here", path)


def read_manifest(directory: Path) -> dict:
    """The manifest of a checkpoint directory, checked for format and shape."""
    file = directory / MANIFEST
    if not file.is_file():
        raise CheckpointError("missing manifest.json (not a checkpoint, or an unfinished save)", file)
    data = file.read_bytes()
    sha_file = directory / MANIFEST_SHA
    if not sha_file.is_file():
        raise CheckpointError(f"missing {MANIFEST_SHA} (the manifest's checksum)", sha_file)
    if sha_file.read_bytes() != f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n".encode():
        raise CheckpointError(f"SHA-256 of {MANIFEST} differs from {MANIFEST_SHA} (the manifest is corrupted or was edited)", file)
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"manifest is not valid JSON ({e})", file) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"manifest 'format' is not {FORMAT!r}", file)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"format_version={version!r}: this dynemb reads version {FORMAT_VERSION}", file)
    if manifest.get("kind") not in ("full", "delta") or not isinstance(manifest.get("id"), str):
        raise CheckpointError("manifest 'kind' must be 'full' or 'delta' and 'id' a string", file)
    tables = manifest.get("tables")
    if not isinstance(tables, dict):
        raise CheckpointError("manifest 'tables' must be an object", file)
    full = manifest["kind"] == "full"
    for name, entry in tables.items():
        _check_table_entry(file, name, entry, full)
    chain, base = manifest.get("chain"), manifest.get("base")
    if not isinstance(chain, list) or not all(isinstance(c, str) for c in chain):
        raise CheckpointError("manifest 'chain' must be a list of ids", file)
    if full and (base is not None or chain):
        raise CheckpointError("a full checkpoint has 'base' null and 'chain' empty (is it a delta?)", file)
    if not full and not (isinstance(base, dict) and isinstance(base.get("id"), str) and isinstance(base.get("path"), str) and chain):
        raise CheckpointError("a delta needs 'base' {id, path} and a non-empty 'chain'", file)
    dense = manifest.get("dense")
    if dense is not None and not (
        isinstance(dense, dict)
        and dense.get("path") == DENSE
        and dense.get("role") == "dense"
        and isinstance(dense.get("sha256"), str)
        and _is_count(dense.get("bytes"))
    ):
        raise CheckpointError(f"manifest 'dense' entry {dense!r} is malformed (path {DENSE!r}, role 'dense', bytes, sha256)", file)
    return manifest


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# File names per role (docs/format.md "Directory"); a role a checkpoint kind does not have is absent.
_ROLE_NAMES = {
    "rows": re.compile(r"rows-(r\d{5}-)?\d{6}\.safetensors"),
    "tombstones": re.compile(r"tombstones-(r\d{5}-)?\d{6}\.safetensors"),
    "admission": re.compile(r"admission\.safetensors"),
    "generator": re.compile(r"generator\.safetensors"),
    "layout": re.compile(r"layout\.safetensors"),
}


def _check_table_entry(file: Path, name: str, entry, full: bool) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"table {name!r}: {what}", file)

    need(isinstance(entry, dict), "entry must be an object")
    for key in ("embedding_dim", "state_dim", "rows", "tombstones"):
        need(isinstance(entry.get(key), int) and not isinstance(entry.get(key), bool) and entry[key] >= 0, f"'{key}' must be an int >= 0")
    need(entry["embedding_dim"] >= 1, "'embedding_dim' must be >= 1")
    need(entry.get("dtype") in ("float32", "float64", "bfloat16", "float16"), f"'dtype'={entry.get('dtype')!r} is not float32, float64, bfloat16 or float16")
    need(
        isinstance(entry.get("counters"), dict)
        and all(_is_count(v) or (isinstance(v, list) and all(_is_count(x) for x in v)) for v in entry["counters"].values()),
        "'counters' must be an object of ints >= 0 (or lists of them)",
    )
    optimizer = entry.get("optimizer")
    need(
        optimizer is None or (isinstance(optimizer, dict) and isinstance(optimizer.get("type"), str) and isinstance(optimizer.get("hyper_parameters"), dict)),
        f"'optimizer'={optimizer!r} must be null or {{type, hyper_parameters}}",
    )
    files = entry.get("files")
    need(isinstance(files, list), "'files' must be a list")
    prefix = table_dir(name) + "/"
    for f in files:
        need(
            isinstance(f, dict)
            and isinstance(f.get("role"), str)
            and f["role"] in _ROLE_NAMES
            and isinstance(f.get("path"), str)
            and f["path"].startswith(prefix)
            and _ROLE_NAMES[f["role"]].fullmatch(f["path"][len(prefix) :]) is not None
            and isinstance(f.get("sha256"), str)
            and _is_count(f.get("bytes")),
            f"file entry {f!r} is malformed (role, path {prefix}<name of the role>, bytes, sha256)",
        )
        if f["role"] in ("rows", "tombstones"):
            need(_is_count(f.get("rows")), f"file {f['path']!r}: 'rows' must be an int >= 0")
    paths = [f["path"] for f in files]
    need(len(set(paths)) == len(paths), "a file is listed twice")
    roles = collections.Counter(f["role"] for f in files)
    need(roles["generator"] == 1 and roles["admission"] <= 1 and roles["layout"] <= 1, "needs one generator file and at most one admission and one layout file")
    need(not (full and roles["tombstones"]) and not (not full and roles["layout"]), "a full checkpoint has no tombstones, a delta no layout")
    rows = sum(f["rows"] for f in files if f["role"] == "rows")
    tombs = sum(f["rows"] for f in files if f["role"] == "tombstones")
    need(rows == entry["rows"], f"'rows'={entry['rows']} but its rows files hold {rows}")
    need(tombs == entry["tombstones"], f"'tombstones'={entry['tombstones']} but its tombstones files hold {tombs}")


def verify_files(directory: Path, manifest: dict, skip_paths: set[str] | frozenset = frozenset()) -> None:
    """Every listed file exists with its size and SHA-256 (except the files in ``skip_paths``,
    whose hash the caller checks as it reads them); no other file is present."""
    listed = set()
    owned = [(name, f) for name, entry in manifest["tables"].items() for f in entry["files"]]
    if manifest.get("dense") is not None:
        owned.append(("(dense)", manifest["dense"]))
    for name, f in owned:
        listed.add(f["path"])
        path = directory / f["path"]
        if not path.is_file():
            raise CheckpointError(f"missing (listed in the manifest for table {name!r})", path)
        size = path.stat().st_size
        if size != f["bytes"]:
            raise CheckpointError(f"has {size} bytes, the manifest says {f['bytes']} (truncated or replaced)", path)
        if f["path"] in skip_paths:
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
        if digest.hexdigest() != f["sha256"]:
            raise CheckpointError("SHA-256 differs from the manifest (corrupted)", path)
    for root, _, names in os.walk(directory):
        for n in names:
            rel = Path(root, n).relative_to(directory).as_posix()
            if rel not in (MANIFEST, MANIFEST_SHA) and rel not in listed:
                raise CheckpointError("not listed in the manifest (extra file)", Path(root, n))


def read_tensors(directory: Path, entry: dict, expected: dict[str, tuple], check_hash: bool = False) -> dict[str, torch.Tensor]:
    """Load one listed file and check its tensors: ``expected`` maps each name to (dtype or
    None, shape with None for any size); nothing more, nothing less. With ``check_hash`` the
    bytes read are checked against the entry's SHA-256 (one read for both)."""
    path = directory / entry["path"]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"not readable ({e})", path) from None
    if check_hash and hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise CheckpointError("SHA-256 differs from the manifest (corrupted)", path)
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, OSError) as e:
        raise CheckpointError(f"not a readable safetensors file ({e})", path) from None
    if set(tensors) != set(expected):
        raise CheckpointError(f"holds tensors {sorted(tensors)}, expected {sorted(expected)}", path)
    for k, (dtype, shape) in expected.items():
        t = tensors[k]
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(f"tensor '{k}' has dtype {t.dtype}, expected {dtype}", path)
        if shape is not None and (t.dim() != len(shape) or any(s is not None and s != v for s, v in zip(shape, t.shape))):
            raise CheckpointError(f"tensor '{k}' has shape {tuple(t.shape)}, expected {tuple('*' if s is None else s for s in shape)}", path)
    return tensors
