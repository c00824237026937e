"""A table larger than memory's share (issue 18): 1.5 M rows of dim 64 live in a disk tier behind a
2^15-row device tier; the table trains until it holds them all and checkpoints, while the
process's anonymous memory (RssAnon after ``malloc_trim``: heap and anonymous maps in use, not
the tier file's page cache) grows by less than 30% of the rows' bytes. Measured in a fresh process, from a baseline taken
after torch's first training steps (its one-time memory is not the table's).

    python tests/storage/test_tier_memory.py measure ROOT    # prints the figures as JSON
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

D, DEVICE_ROWS, KEYS = 64, 1 << 15, 1_500_000
PER_STEP = 1 << 15  # new keys a step


def rss_anon() -> int:
    """Bytes of anonymous resident memory of this process (Linux /proc), after glibc hands its
    freed heap back (``malloc_trim``): memory in use, not the allocator's spare pages."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def measure(root: Path) -> dict:
    import torch

    import dynemb
    import dynemb.checkpoint

    torch.set_num_threads(1)
    (root / "tiers").mkdir(parents=True, exist_ok=True)
    disk_rows = KEYS + KEYS // 16 - DEVICE_ROWS  # headroom: a hash index does not fill every slot
    tiers = [dynemb.Tier("device", rows=DEVICE_ROWS), dynemb.Tier("disk", rows=disk_rows, path=str(root / "tiers"))]
    keys = torch.randperm(KEYS * 4, generator=torch.Generator().manual_seed(0))[:KEYS] - 2 * KEYS  # distinct, negatives too
    # torch's own first-use memory (autograd, allocator caches: ~70 MiB whatever the table) is not
    # the table's: two steps of a small table of the same shape come before the baseline.
    warm = dynemb.DynamicEmbedding(D, 1 << 16, optimizer=dynemb.optim.SGD(lr=0.1), check_mode="count")
    for lo in (0, PER_STEP):
        warm(keys[lo : lo + PER_STEP]).sum().backward()
    del warm
    start = rss_anon()
    table = dynemb.DynamicEmbedding(D, DEVICE_ROWS + disk_rows, optimizer=dynemb.optim.SGD(lr=0.1), tiers=tiers, check_mode="count")
    for lo in range(0, KEYS, PER_STEP):
        table(keys[lo : lo + PER_STEP]).sum().backward()
    trained = rss_anon()
    dynemb.checkpoint.save(table, root / "ckpt")
    saved = rss_anon()
    stats = table.stats()
    return {
        "size": stats["size"],
        "failed_inserts": stats["failed_inserts"],
        "rows_bytes": KEYS * D * 4,
        "growth_trained": trained - start,
        "growth_saved": saved - start,
        "tiers": stats["tiers"],
    }


def test_a_disk_tier_of_1_5_m_rows_trains_and_checkpoints_in_little_anonymous_memory(tmp_path):
    done = subprocess.run([sys.executable, __file__, "measure", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["size"] == KEYS and figures["failed_inserts"] == 0, figures
    assert figures["tiers"][0]["rows"] == DEVICE_ROWS and figures["tiers"][1]["rows"] == KEYS - DEVICE_ROWS, figures["tiers"]
    limit = 0.3 * figures["rows_bytes"]
    for when in ("growth_trained", "growth_saved"):
        assert figures[when] < limit, f"{when}: anonymous memory grew {figures[when] / 2**20:.0f} MiB, limit {limit / 2**20:.0f} MiB ({figures})"


if __name__ == "__main__" and sys.argv[1:2] == ["measure"]:
    print(json.dumps(measure(Path(sys.argv[2]))))
