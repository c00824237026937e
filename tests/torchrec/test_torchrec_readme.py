"""The README's TorchRec example runs as written, and only dynemb/torchrec imports torchrec."""

from __future__ import annotations

import ast
import pathlib
import re

import dynemb

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_torchrec_example_runs(tmp_path, monkeypatch):
    block = re.search(r"## TorchRec\n.*?```python\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md has no python example under '## TorchRec'"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)
    assert (tmp_path / "dlrm.pt").exists()
    assert type(scope["converted"]) is dynemb.torchrec.EmbeddingBagCollection


def test_only_the_torchrec_package_imports_torchrec():
    root = pathlib.Path(dynemb.__file__).parent
    for path in root.rglob("*.py"):
        if path.is_relative_to(root / "torchrec"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("torchrec", "fbgemm_gpu"), f"{path.relative_to(root)} imports {name}"
