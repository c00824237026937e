"""Building and loading the compiled CPU kernels: every ``*.cpp`` of this folder, one shared
library, built on first use with torch's extension builder (ninja + the system C++ compiler)
and cached by the sources' hash; functions called through ctypes (docs/design/0037).

The sources include no torch header (a plain C ABI on raw pointers), so a cold build takes
about a second; the cache lives in ``$DYNEMB_KERNEL_DIR``, else ``$XDG_CACHE_HOME/dynemb`` or
``~/.cache/dynemb``, else a temporary folder.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
I64, PTR, F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double

# Each exported function's ctypes argument types: p a pointer (data_ptr() or None), i an int64,
# d a double. The C side returns int64 (a count or 0) from every function.
SIGNATURES = {
    "dyn_locate": "pipiippppipppiipi",
    "dyn_place_free": "pippppiiiipppippppipppi",
    "dyn_insert_new": "pippiiiipiipppppiippiippppppiiiiipiiipipp",
    "dyn_dedup": "pipppppppii",
    "dyn_sort_unique": "pipppppppppi",
    "dyn_rows_at": "piipipi",
    "dyn_rows_put": "piippii",
    "dyn_rows_of_new": "piippipppi",
    "dyn_rows_update": "pippiiiiddddddpi",
    "dyn_rows_update_bags": "pippipppiiiiddddddpi",
    "dyn_init_rows": "pippiiipdddpi",
    "dyn_candidates": "ppppiippi",
    "dyn_make_room": "pippiipiiiipppppiiippppipipi",
    "dyn_follow": "ppippii",
    "dyn_place_rest": "pippiipiiiippppppipipppipiiipiipipppi",
    "dyn_evict_for": "pippiiiipppppipiipppppii",
    "dyn_evict_scratch_bytes": "iii",
    "dyn_upsert_found": "pippiiiipiippppipipiippppppi",
    "dyn_copy_bags": "piiipppppi",
    "dyn_sum_bags": "pipppiiipi",
}
_CODES = {"p": PTR, "i": I64, "d": F64}


def sources() -> list[Path]:
    return sorted(HERE.glob("*.cpp"))


# The compiler's flags, part of the cache key with the sources.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]


def source_hash() -> str:
    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in sorted(HERE.glob("*.cpp")) + sorted(HERE.glob("*.h")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """The first writable of $DYNEMB_KERNEL_DIR, the user cache, a temporary folder."""
    candidates = []
    if os.environ.get("DYNEMB_KERNEL_DIR"):
        candidates.append(Path(os.environ["DYNEMB_KERNEL_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME")
    candidates.append(Path(xdg) / "dynemb" if xdg else Path.home() / ".cache" / "dynemb")
    candidates.append(Path(tempfile.gettempdir()) / f"dynemb-{os.getuid()}")
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
            return path
        except OSError:
            continue
    raise OSError(f"no writable folder for the kernel cache among {[str(p) for p in candidates]}")


def build() -> ctypes.CDLL:
    """Build (or find in the cache) and load the kernel library; raises on any failure."""
    from torch.utils import cpp_extension

    name = f"dynemb_kernels_{source_hash()}"
    folder = cache_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"{name}.so"

    def compile_() -> None:
        # ninja rebuilds only what changed and torch's file baton keeps parallel builders apart.
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources()],
            extra_cflags=[*CFLAGS, f"-I{HERE}"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )

    if not library.exists():
        compile_()
    try:
        lib = ctypes.CDLL(str(library))
    except OSError:
        # Seen while another process was still writing it: wait for its build (the baton), retry.
        compile_()
        lib = ctypes.CDLL(str(library))
    for fn, codes in SIGNATURES.items():
        f = getattr(lib, fn)
        f.argtypes = [_CODES[c] for c in codes]
        f.restype = I64
    return lib
