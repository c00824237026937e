"""The disk tier benchmark's stores (``disk_tier.py``): one row store per engine, and page-cache helpers.

R rows, W float32 columns a row. Every store holds rows [R, W] addressed by row id and offers
``gather(ids) -> [n, W]``, ``scatter(ids, rows)``, ``close()`` / ``open()`` (reopen the same files);
built from a reference table [R, W] and the row ids written before timing.
"""

from __future__ import annotations

import mmap
import os
import subprocess
from pathlib import Path

import numpy as np
import torch

WIDTH = 128 + 1  # W1's D = 128 embedding columns + 1 row-wise Adagrad state column
KEY_DTYPE = np.dtype(">u8")  # big-endian row ids: the stores' key order is the row order


def mapped_resident(path: Path) -> dict[str, int]:
    """Resident and anonymous bytes of this process's mappings of files under ``path`` (/proc/self/smaps)."""
    out, inside = {"Rss": 0, "Anonymous": 0}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and (head[5] == str(path) or head[5].startswith(f"{path}/"))
        elif inside and head and head[0][:-1] in out:
            out[head[0][:-1]] += int(head[1]) * 1024
    return out


def files_of(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path``'s files in the page cache (util-linux ``fincore``), None without it."""
    total = 0
    for f in files_of(path):
        try:
            out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(f)], capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        total += int(out.stdout.split()[0])
    return total


def drop_cache(path: Path) -> None:
    """Write ``path``'s files back and drop their pages from the page cache (unmapped files only)."""
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def key_bytes(ids: torch.Tensor) -> list[bytes]:
    b = ids.numpy().astype(KEY_DTYPE).tobytes()
    return [b[i : i + 8] for i in range(0, len(b), 8)]


def value_bytes(rows: torch.Tensor) -> list[bytes]:
    b = rows.contiguous().numpy().tobytes()
    n = WIDTH * 4
    return [b[i : i + n] for i in range(0, len(b), n)]


def rows_of(values: list) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(values)), dtype=torch.float32).view(-1, WIDTH)


class Memory:
    """The reference: every row in one in-memory tensor."""

    name = "memory"

    def __init__(self, table: torch.Tensor):
        self.t = table

    def open(self):
        pass

    def close(self):
        pass

    def gather(self, ids):
        return self.t.index_select(0, ids)

    def scatter(self, ids, rows):
        self.t.index_copy_(0, ids, rows)


class MappedFile(Memory):
    """A row file of [R, W] float32, mapped shared; row id i at byte offset i * W * 4."""

    def __init__(self, path: Path, table: torch.Tensor, name: str = "mmap", sort: bool = False, advice: int | None = None, prefetch: bool = False):
        self.name, self.path, self.sort, self.advice, self.prefetch = name, path, sort, advice, prefetch
        self.shape = tuple(table.shape)
        table.numpy().tofile(path)
        self.t = self.m = None
        self.open()

    def open(self):
        if self.advice is None:
            self.t = torch.from_file(str(self.path), shared=True, size=self.shape[0] * self.shape[1], dtype=torch.float32).view(self.shape)
        else:
            with open(self.path, "r+b") as f:
                self.m = mmap.mmap(f.fileno(), 0)
            self.m.madvise(self.advice)
            self.t = torch.frombuffer(self.m, dtype=torch.float32).view(self.shape)

    def close(self):
        self.t = None  # unmaps (torch.from_file's storage) or releases the buffer export
        if self.m is not None:
            self.m.close()
            self.m = None

    def will_need(self, ids):
        """madvise(WILLNEED) the pages of ``ids``' rows, one call per run of adjacent pages: the
        kernel starts all their reads at once instead of one synchronous read per page fault."""
        row = self.shape[1] * 4
        pages = torch.cat([ids * row // mmap.PAGESIZE, (ids * row + row - 1) // mmap.PAGESIZE]).unique()
        starts = torch.ones(pages.numel(), dtype=torch.bool)
        starts[1:] = pages[1:] != pages[:-1] + 1
        first = pages[starts]
        lasts = torch.cat([pages[:-1][starts[1:]], pages[-1:]]) + 1
        for a, b in zip(first.tolist(), lasts.tolist()):
            self.m.madvise(mmap.MADV_WILLNEED, a * mmap.PAGESIZE, (b - a) * mmap.PAGESIZE)

    def gather(self, ids):
        if self.prefetch:
            self.will_need(ids)
        if not self.sort:
            return self.t.index_select(0, ids)
        sorted_ids, order = ids.sort()
        return torch.empty(ids.numel(), self.shape[1]).index_copy_(0, order, self.t.index_select(0, sorted_ids))

    def scatter(self, ids, rows):
        if self.prefetch:
            self.will_need(ids)
        if not self.sort:
            self.t.index_copy_(0, ids, rows)
            return
        sorted_ids, order = ids.sort()
        self.t.index_copy_(0, sorted_ids, rows.index_select(0, order))


class NumpyMemmap(MappedFile):
    def __init__(self, path: Path, table: torch.Tensor):
        super().__init__(path, table, name="np.memmap")

    def open(self):
        self.a = np.memmap(self.path, dtype=np.float32, mode="r+", shape=self.shape)

    def close(self):
        self.a = None

    def gather(self, ids):
        return torch.from_numpy(self.a[ids.numpy()])

    def scatter(self, ids, rows):
        self.a[ids.numpy()] = rows.numpy()


class RocksDB(Memory):
    name = "rocksdb"

    def __init__(self, path: Path, table: torch.Tensor, prefill: torch.Tensor, chunk: int = 1 << 16):
        import rocksdict

        self.rd, self.path = rocksdict, path
        self.write_opt = rocksdict.WriteOptions()
        self.write_opt.disable_wal = True  # scratch tier: nothing to recover after a crash
        self.open()
        for start in range(0, prefill.numel(), chunk):
            ids = prefill[start : start + chunk]
            self.scatter(ids, table.index_select(0, ids))
        self.db.flush()
        self.db.compact_range(None, None)  # steady state: no L0 backlog from the bulk load

    def open(self):
        opt = self.rd.Options(raw_mode=True)
        opt.create_if_missing(True)
        opt.set_compression_type(self.rd.DBCompressionType.none())  # float rows do not compress
        self.db = self.rd.Rdict(str(self.path), opt)

    def close(self):
        self.db.close()
        self.db = None

    def gather(self, ids):
        return rows_of(self.db.get(key_bytes(ids)))

    def scatter(self, ids, rows):
        batch = self.rd.WriteBatch(raw_mode=True)
        for k, v in zip(key_bytes(ids), value_bytes(rows)):
            batch.put(k, v)
        self.db.write(batch, self.write_opt)


class LMDB(Memory):
    name = "lmdb"

    def __init__(self, path: Path, table: torch.Tensor, prefill: torch.Tensor, chunk: int = 1 << 16):
        import lmdb

        self.lmdb, self.path = lmdb, path
        # B-tree pages of 4 KiB hold 7 rows of 516 bytes: leave room for the tree and free pages.
        self.map_size = 3 * table.numel() * 4
        self.open()
        ids = prefill.sort().values
        for start in range(0, ids.numel(), chunk):
            part = ids[start : start + chunk]
            with self.env.begin(write=True) as txn:
                txn.cursor().putmulti(zip(key_bytes(part), value_bytes(table.index_select(0, part))), append=True)

    def open(self):
        self.env = self.lmdb.open(
            str(self.path), map_size=self.map_size, writemap=True, sync=False, metasync=False, map_async=True, readahead=False, max_readers=4
        )

    def close(self):
        self.env.close()
        self.env = None

    def gather(self, ids):
        with self.env.begin(buffers=True) as txn:
            got = txn.cursor().getmulti(key_bytes(ids))
            if len(got) != ids.numel():
                raise KeyError(f"lmdb: {ids.numel() - len(got)} of {ids.numel()} rows missing")
            return rows_of([v for _, v in got])

    def scatter(self, ids, rows):
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(key_bytes(ids), value_bytes(rows)))
