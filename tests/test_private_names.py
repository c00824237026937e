"""No dynemb module reads or writes another object's underscore names (DESIGN.md, "One engine").

Walks every file of src/dynemb with ``ast``. A violation is

- an attribute ``x._name`` (one leading underscore, not a dunder),
- ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` of ``x`` with a literal ``"_name"``,
- ``from dynemb.<module> import _name`` (another module's private),

unless ``x`` is ``self``, ``cls`` or ``super()``, or ``_name`` is defined in the same file (a
``def _name``, a class attribute, a ``self._name =`` / ``cls._name =`` assignment: a private of the
file's own classes), or ``_name`` is in :data:`ALLOWED`, the one allow-list of torch's and
TorchRec's privates where they offer no public seam. docs/design/0026-guard-rails.md.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "dynemb"

# Name -> why dynemb may touch it on an object it does not own. Every entry must still be used
# (a stale entry fails the test), so the list only shrinks when a seam appears.
ALLOWED: dict[str, str] = {
    "_C": "torch._C: the C++ bindings; workspace.py reads a storage's use count there (torch has no public one)",
    "_storage_Use_Count": "torch._C._storage_Use_Count: C++ owners of a storage, how workspace.py knows a recycled buffer is unshared",
    "_cdata": "a torch storage's C++ handle, the argument _storage_Use_Count takes",
    "_optimizer_classes": "the optimizer class torch's apply_optimizer_in_backward records on each parameter; the only record of it "
    "(TorchRec's sharders read it the same way); dynemb's TableHandles read it to choose the tables' optimizer",
    "_optimizer_kwargs": "the optimizer kwargs torch's apply_optimizer_in_backward records beside _optimizer_classes (same reason)",
    "_get_default_store": "torch.distributed.distributed_c10d._get_default_store: the rendezvous store of the default group; "
    "Comm leaves out-of-band notes there (peer failure, call sequence) that a collective stuck on a dead peer cannot carry",
}

ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_object(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object whose class this code belongs to."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _defined_here(tree: ast.Module) -> set[str]:
    """Private names the file's own code defines: functions and classes, class attributes,
    attributes assigned on self / cls."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and _own_object(t.value):
                    names.add(t.attr)
    return {n for n in names if _private(n)}


def _accesses(tree: ast.Module) -> list[tuple[int, str, str, ast.expr | None]]:
    """(line, private name, expression, object or None for an import) of every private access."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            found.append((node.lineno, node.attr, ast.unparse(node), node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                found.append((node.lineno, name.value, ast.unparse(node), node.args[0]))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dynemb":
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, alias.name, f"from {node.module} import {alias.name}", None))
    return found


def scan() -> tuple[list[str], set[str]]:
    """Violations as ``file:line: expression``, and the allow-listed names that were used."""
    violations, used = [], set()
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        own = _defined_here(tree)
        for line, name, expression, obj in sorted(_accesses(tree), key=lambda a: (a[0], a[2])):
            if obj is not None and (_own_object(obj) or name in own):
                continue
            if name in ALLOWED:
                used.add(name)
                continue
            violations.append(f"{path.relative_to(SRC.parents[1])}:{line}: {expression}")
    return violations, used


def test_no_private_names_of_other_objects():
    violations, _ = scan()
    print("\n".join(violations))
    assert not violations, f"{len(violations)} accesses to another object's underscore names:\n" + "\n".join(violations)


def test_allow_list_has_no_stale_entries():
    _, used = scan()
    assert set(ALLOWED) == used, f"allow-listed names no module uses any more (drop them): {sorted(set(ALLOWED) - used)}"


def test_scanner_flags_and_exempts(tmp_path):
    # The rules themselves, on a file written for them: each flagged line is flagged, nothing else.
    source = """
from dynemb.nn.module import _hidden, public
class A:
    _counter = 0
    def __init__(self, other):
        self._mine = 1
        super()._apply(None)
        other._mine = 2
        other._theirs = 3
        getattr(other, "_theirs")
        setattr(other, "_mine", 1)
        other.__dict__
        torch._C
"""
    tree = ast.parse(source)
    own = _defined_here(tree)
    assert own == {"_counter", "_mine"}
    flagged = sorted(
        (line, expression)
        for line, name, expression, obj in _accesses(tree)
        if not (obj is not None and (_own_object(obj) or name in own)) and name not in ALLOWED
    )
    assert flagged == [(2, "from dynemb.nn.module import _hidden"), (9, "other._theirs"), (10, "getattr(other, '_theirs')")]
