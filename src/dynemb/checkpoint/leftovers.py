"""Temporary directories of killed saves: each is named after the process writing it, and the
next save or load in its directory removes those whose writer is dead (docs/design/0022).

A save writes into ``.<name>.tmp-<host>-<boot>-<pid>-<start>-<random>`` next to its target:

* ``host``: 8 hex digits of SHA-256 over the host name and the writer's pid namespace, so that
  a pid is only ever looked up where it means the same process;
* ``boot``: 8 hex digits of SHA-256 over the kernel's boot id (a writer of an earlier boot of
  this host is dead);
* ``pid`` and ``start``: the writer's process id and start time (``/proc/<pid>/stat`` field 22,
  clock ticks since boot; 0 where there is no ``/proc``), so that a pid reused by another
  process does not keep a dead writer's directory.

Directories named ``.<name>.tmp-<12 hex digits>`` (written before the writer was named), those
of other hosts (or pid namespaces) and those owned by another user are removed only when nothing
was created in them for :data:`FOREIGN_AGE_S`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

# A writer whose liveness cannot be checked from here (another host, pid namespace or user, or
# a directory from before writers were named) is presumed dead once no file was created in its
# directory for this long: a save creates a file every few seconds, so a day leaves room for any
# stall and any clock skew between hosts.
FOREIGN_AGE_S = 24 * 3600

_TMP = re.compile(r"\.(?P<name>.+)\.tmp-(?:(?P<host>[0-9a-f]{8})-(?P<boot>[0-9a-f]{8})-(?P<pid>[0-9]{1,10})-(?P<start>[0-9]{1,20})-[0-9a-f]{8}|[0-9a-f]{12})")
# What a Writer (files.py) puts at the top of its directory; anything else there means the
# directory is not one of ours, and it is left alone.
_TOP_NAMES = frozenset({"tables", "dense.safetensors", "manifest.json", "manifest.sha256"})


def _digest8(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


@functools.cache
def _host() -> str:
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return _digest8(f"{socket.gethostname()}\0{namespace}")


@functools.cache
def _boot() -> str:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return _digest8(boot_id)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of process ``pid`` from
    ``/proc/<pid>/stat``, or None if there is no such process. Raises OSError when ``/proc``
    cannot tell."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces and ')': split after the last one.
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def _has_proc() -> bool:
    return Path("/proc/self/stat").is_file()


def tmp_dir(path: Path, pid: int | None = None) -> Path:
    """A new temporary directory name for a save to ``path`` written by process ``pid`` (a
    running process; default: this one)."""
    pid = os.getpid() if pid is None else pid
    found = _stat(pid) if _has_proc() else None
    start = 0 if found is None else found[1]
    return path.parent / f".{path.name}.tmp-{_host()}-{_boot()}-{pid}-{start}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int, start: int) -> bool:
    """Whether process ``pid``, started at ``start`` (0: unknown), runs on this host; True when
    it cannot be told."""
    if _has_proc():
        try:
            found = _stat(pid)
        except (OSError, ValueError, IndexError):
            return True
        # A zombie ('Z') or dying ('X') process writes nothing more.
        return found is not None and found[0] not in ("Z", "X") and (start == 0 or found[1] == start)
    if os.name == "nt":
        # os.kill would terminate the process there; without /proc there is no safe probe.
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _last_activity(directory: Path) -> float:
    """Latest modification time of ``directory`` and of the folders below it up to a table's
    folder: creating a file in a folder updates the folder's time."""
    latest = directory.lstat().st_mtime
    tables = directory / "tables"
    if tables.is_dir():
        latest = max(latest, tables.lstat().st_mtime)
        with os.scandir(tables) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
    return latest


def _is_ours(entry: os.DirEntry) -> re.Match | None:
    """The parsed name if ``entry`` is a directory (not a link) named and filled like a Writer's."""
    found = _TMP.fullmatch(entry.name)
    if found is None or not entry.is_dir(follow_symlinks=False):
        return None
    with os.scandir(entry.path) as it:
        for child in it:
            if child.name not in _TOP_NAMES or (child.name == "tables") != child.is_dir(follow_symlinks=False):
                return None
    return found


def _dead(found: re.Match, entry: os.DirEntry, now: float) -> bool:
    # Another user's processes may be hidden from us (/proc mounted with hidepid): their
    # directories are judged by age, like another host's.
    mine = not hasattr(os, "getuid") or entry.stat(follow_symlinks=False).st_uid == os.getuid()
    if found["host"] == _host() and mine:
        # Same host and pid namespace: an earlier boot's writer is dead; this boot's is looked up.
        return found["boot"] != _boot() or not _alive(int(found["pid"]), int(found["start"]))
    return now - _last_activity(Path(entry.path)) > FOREIGN_AGE_S


def sweep(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary directories of dead writers in ``directory``; returns those removed.

    Only directories named and filled like a Writer's are considered (see the module doc); a
    writer that may be alive keeps its directory. Never raises: a directory that cannot be read
    or removed is left as it is.
    """
    now = time.time()
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        try:
            found = _is_ours(entry)
            if found is None or not _dead(found, entry, now):
                continue
            # Another process may sweep the same directory at once: whatever it removed first is gone.
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed
