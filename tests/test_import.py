"""`import dynemb` stays lean, and the public names are pinned."""

from __future__ import annotations

import subprocess
import sys

import dynemb

PUBLIC = {
    "Admission",
    "CheckMode",
    "DynamicEmbedding",
    "DynamicEmbeddingBag",
    "DynamicTable",
    "InitKind",
    "Initializer",
    "InsertionError",
    "KeyIndex",
    "PoolingMode",
    "ScoreStrategy",
    "TableConfig",
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
