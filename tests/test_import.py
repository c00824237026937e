"""`import dynemb` stays lean, and the public names are pinned."""

from __future__ import annotations

import subprocess
import sys

import dynemb

PUBLIC = {
    "Admission",
    "Backend",
    "CheckMode",
    "CheckpointError",
    "DynamicEmbedding",
    "DynamicEmbeddingBag",
    "DynamicEmbeddingBagCollection",
    "DynamicEmbeddingCollection",
    "DynamicTable",
    "InitKind",
    "Initializer",
    "InsertionError",
    "KeyIndex",
    "NonFiniteGrads",
    "PooledEmbeddings",
    "PoolingMode",
    "ScoreStrategy",
    "TableConfig",
    "Tier",
    "checkpoint",
    "clip_grad_norm_",
    "optim",
}


def test_import_does_not_pull_triton_torchrec_or_cuda():
    code = (
        "import sys, dynemb, torch\n"
        "bad = [m for m in ('triton', 'torchrec', 'fbgemm_gpu') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "t = dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.SGD(lr=0.1))\n"
        "t(torch.tensor([1, 2])).sum().backward()\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_api():
    assert set(dynemb.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(dynemb, name), name
    assert set(dynemb.optim.__all__) == {"SGD", "Adagrad", "RowWiseAdagrad", "Adam", "RowOptimizer"}
    assert {"DynamicEmbedding", "DynamicEmbeddingBag", "DynamicTable", "TableEngine", "Resolved"} <= set(dynemb.nn.__all__)


# Each layer may import the shared modules and the layers listed before it (DESIGN.md, "Layers").
_SHARED = {"dynemb._version", "dynemb.types", "dynemb.config", "dynemb.errors", "dynemb.hashing", "dynemb.workspace"}
_LAYERS = ["kernels", "table", "storage", "optim", "nn", "distributed", "checkpoint"]


def test_layers_import_only_the_layers_above_them():
    import ast
    import pathlib

    root = pathlib.Path(dynemb.__file__).parent
    for i, layer in enumerate(_LAYERS):
        allowed = _SHARED | {f"dynemb.{other}" for other in _LAYERS[: i + 1]}
        for path in (root / layer).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                for name in names:
                    if name.startswith("dynemb"):
                        assert any(name == ok or name.startswith(ok + ".") for ok in allowed), f"{path.name} imports {name}"


def test_contracts_are_protocols():
    from typing import Protocol

    from dynemb.storage.base import RowStore
    from dynemb.storage.device_store import DeviceRowStore
    from dynemb.table.base import Index

    assert Protocol in Index.__mro__ and Protocol in RowStore.__mro__
    assert isinstance(dynemb.KeyIndex(capacity=64), Index)
    assert isinstance(DeviceRowStore(4, 8), RowStore)
