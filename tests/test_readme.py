"""The README's usage example runs as written."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch):
    text = README.read_text()
    block = re.search(r"## Use\s+```python\n(.*?)```", text, re.S)
    assert block, "README.md has no python example under '## Use'"
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "README.md", "exec"), {})
    assert (tmp_path / "table.pt").exists()


def test_readme_collections_example_runs():
    text = README.read_text()
    block = re.search(r"## Collections\s+.*?```python\n(.*?)```", text, re.S)
    assert block, "README.md has no python example under '## Collections'"
    scope: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)
    stats = scope["ebc"].stats()["item"]
    assert stats["optimizer_step"] == 1 and stats["size"] == 2


def test_readme_checkpoints_example_runs(tmp_path, monkeypatch):
    text = README.read_text()
    block = re.search(r"## Checkpoints\s+.*?```python\n(.*?)```", text, re.S)
    assert block, "README.md has no python example under '## Checkpoints'"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)
    assert scope["report"] == {"users": {"rows": 3, "dropped": 0}}
