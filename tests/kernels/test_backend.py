"""Choosing the kernels: the ``backend`` config field, ``DYNEMB_BACKEND``, and a machine where
the kernels cannot build (every feature on plain torch, one warning)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dynemb
from dynemb.kernels import uses_native

D = 4


def run(code: str, env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_backend_field_is_checked():
    with pytest.raises(ValueError, match="backend='fast'"):
        dynemb.TableConfig(embedding_dim=D, capacity=8, backend="fast")
    assert dynemb.TableConfig(embedding_dim=D, capacity=8, backend="torch").backend is dynemb.Backend.TORCH


def test_backend_torch_runs_no_kernel_and_native_does():
    assert not dynemb.DynamicEmbedding(D, 64, backend="torch").engines[0].index.native
    if uses_native("native", "cpu"):
        assert dynemb.DynamicEmbedding(D, 64, backend="native").engines[0].index.native


def test_tables_of_two_backends_are_not_grouped():
    tables = [dynemb.TableConfig(embedding_dim=D, capacity=64, name=n, backend=b) for n, b in (("a", "torch"), ("b", "native"))]
    assert len(dynemb.DynamicEmbeddingCollection(tables).engines) == 2


CODE = """
    import warnings, torch, dynemb
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.SGD(lr=0.1))
        u = dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.SGD(lr=0.1))
        t(torch.tensor([1, 2, 2, -1])).sum().backward()
    print("native", t.engines[0].index.native, u.engines[0].index.native)
    print("warnings", sum("compiled CPU kernels unavailable" in str(w.message) for w in caught))
    try:
        dynemb.DynamicEmbedding(4, 64, backend="native")
        print("native table built")
    except ValueError as e:
        print("raised", "backend='native'" in str(e))
"""


def test_without_a_compiler_auto_warns_once_and_native_raises(tmp_path):
    env = {"CXX": str(tmp_path / "no-such-compiler"), "DYNEMB_KERNEL_DIR": str(tmp_path / "cache"), "DYNEMB_BACKEND": ""}
    out = run(CODE, env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "native False False" in out.stdout and "warnings 1" in out.stdout and "raised True" in out.stdout, out.stdout


def test_environment_variable_decides_auto(tmp_path):
    out = run(CODE, {"DYNEMB_BACKEND": "torch"}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "native False False" in out.stdout and "warnings 0" in out.stdout, out.stdout
    out = run("import dynemb; dynemb.DynamicEmbedding(4, 8)", {"DYNEMB_BACKEND": "fastest"}, tmp_path)
    assert out.returncode != 0 and "DYNEMB_BACKEND='fastest'" in out.stderr


def test_cold_build_into_an_empty_cache(tmp_path):
    out = run(
        "import time, dynemb.kernels as k; t = time.time(); assert k.library() is not None; print(time.time() - t)",
        {"DYNEMB_KERNEL_DIR": str(tmp_path / "cold")},
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    # The bound on a cold build, with room for a loaded CI machine.
    assert float(out.stdout.split()[-1]) < 30
    assert any((tmp_path / "cold").iterdir())


def test_cuda_tables_run_torch_under_every_backend():
    assert not uses_native("native", torch.device("cuda", 0))
