"""The ctypes signatures the kernel library is loaded with (``build.SIGNATURES``) against the
C++ definitions: ctypes does not check a call's argument count against ``argtypes``, so a
parameter added on one side only would pass every later argument one place off, unnoticed
(it did, once: a thread count read from a pointer)."""

from __future__ import annotations

import re
from pathlib import Path

from dynemb.kernels.build import SIGNATURES

KERNELS = Path(__file__).resolve().parents[2] / "src" / "dynemb" / "kernels"
DEFINITION = re.compile(r'extern "C" (?:\w+ )+?(dyn_\w+)\(([^;{]*)\)\s*\{', re.S)


def _code(param: str) -> str:
    """The ctypes code of one C parameter: p (pointer), d (double), i (integer)."""
    if "*" in param:
        return "p"
    return "d" if re.search(r"\bdouble\b", param) else "i"


def definitions() -> dict[str, str]:
    found = {}
    for source in sorted(KERNELS.glob("*.cpp")):
        text = re.sub(r"//[^\n]*", "", source.read_text())
        for name, params in DEFINITION.findall(text):
            found[name] = "".join(_code(p) for p in params.split(",") if p.strip())
    return found


def test_every_signature_matches_its_definition():
    defined = definitions()
    assert set(SIGNATURES) <= set(defined), f"no definition found for {sorted(set(SIGNATURES) - set(defined))}"
    mismatched = {name: (codes, defined[name]) for name, codes in SIGNATURES.items() if codes != defined[name]}
    assert not mismatched, f"SIGNATURES differ from the C++ definitions (given, defined): {mismatched}"


def test_the_parser_sees_every_exported_kernel():
    # Every definition the library exports is in SIGNATURES (else Python calls it untyped).
    defined = definitions()
    assert len(defined) >= 10
    assert set(defined) <= set(SIGNATURES), f"exported but not typed: {sorted(set(defined) - set(SIGNATURES))}"


def test_the_build_cache_key_follows_the_compiler_flags(monkeypatch):
    # A library built with other flags is another library: a flag changed in build.py must not
    # load the one cached under the old flags.
    from dynemb.kernels import build

    before = build.source_hash()
    monkeypatch.setattr(build, "CFLAGS", [*build.CFLAGS, "-DDYNEMB_OTHER_FLAGS"])
    assert build.source_hash() != before
