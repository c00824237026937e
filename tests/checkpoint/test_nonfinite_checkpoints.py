"""Whatever save completes, load reads: rows made non-finite on purpose (nonfinite_grads='apply')
are saved with a warning and load with a warning, in full checkpoints and deltas alike."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import sys

import pytest
import torch
from ckpt_models import contents as model_contents
from safetensors.torch import load_file, save_file

import dynemb
from dynemb.checkpoint import files
from dynemb.checkpoint.__main__ import main

COMPAT = pathlib.Path(__file__).with_name("compat")
sys.path.insert(0, str(COMPAT))

from compat_model import CompatModel, flat  # noqa: E402

D = 4
BIG = 3e38


def build(policy: str = "apply"):
    return dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.Adam(lr=1.0), nonfinite_grads=policy, score_strategy="step")


def step(table, keys: list[int], big: int | None = None):
    """One lookup of ``keys``; ``big`` gets a gradient that overflows Adam's second moment."""
    ids = torch.tensor(keys)
    scale = torch.ones(len(keys), 1)
    if big is not None:
        scale[keys.index(big)] = BIG
    (table(ids) * scale).sum().backward()


def contents(table) -> dict[str, torch.Tensor]:
    chunks = list(table.export())
    out = {k: torch.cat([c[k] for c in chunks]) for k in ("keys", "embeddings", "optimizer_state", "scores")}
    order = torch.argsort(out["keys"])
    return {k: v[order] for k, v in out.items()}


def assert_same(a: dict, b: dict) -> None:
    for k in a:
        # Bitwise, NaN and inf included.
        assert torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k], b[k].view(torch.uint8) if b[k].is_floating_point() else b[k]), k


def test_full_and_delta_with_nonfinite_rows_save_and_load(tmp_path):
    table = build()
    step(table, [1, 2, 3])
    table.insert(torch.tensor([9]), torch.full((1, D), BIG))
    step(table, [1, 9], big=9)
    assert not torch.isfinite(contents(table)["optimizer_state"]).all()
    with pytest.warns(RuntimeWarning, match=r"saving table 'table': the rows of 1 key\(s\) \[9\] hold NaN or inf"):
        dynemb.checkpoint.save(table, tmp_path / "base")
    full = contents(table)

    # The delta holds only rows touched since (key 9 is not): it writes no non-finite row.
    step(table, [2, 4])
    dynemb.checkpoint.save_delta(table, tmp_path / "d1", base=tmp_path / "base")
    delta = contents(table)

    for path, want in ((tmp_path / "base", full), (tmp_path / "d1", delta)):
        fresh = build()
        with pytest.warns(RuntimeWarning, match=r"the rows of 1 key\(s\) \[9\] hold NaN or inf"):
            dynemb.checkpoint.load(fresh, path)
        assert_same(contents(fresh), want)


def test_a_nonfinite_row_replaced_by_a_delta_loads_without_warning(tmp_path, recwarn):
    table = build()
    table.insert(torch.tensor([9]), torch.full((1, D), BIG))
    step(table, [9], big=9)
    dynemb.checkpoint.save(table, tmp_path / "base")
    table.insert(torch.tensor([9]), torch.zeros(1, D + table.state_dim))
    dynemb.checkpoint.save_delta(table, tmp_path / "d1", base=tmp_path / "base")
    recwarn.clear()
    fresh = build()
    dynemb.checkpoint.load(fresh, tmp_path / "d1")
    assert not [w for w in recwarn if "NaN or inf" in str(w.message)]
    assert_same(contents(fresh), contents(table))


def test_default_policy_keeps_checkpoints_finite(tmp_path, recwarn):
    table = build("skip")
    table.insert(torch.tensor([9]), torch.full((1, D), BIG))
    step(table, [1, 9], big=9)
    assert table.stats()["nonfinite_grads"] == 1
    dynemb.checkpoint.save(table, tmp_path / "ck")
    fresh = build("skip")
    dynemb.checkpoint.load(fresh, tmp_path / "ck")
    assert not [w for w in recwarn if "NaN or inf" in str(w.message)]
    assert_same(contents(fresh), contents(table))
    assert fresh.stats()["nonfinite_grads"] == 1


def _patch_rows(checkpoint: pathlib.Path, table: str, keys: dict[int, tuple[str, int, float]]) -> None:
    """Write ``value`` into column ``col`` of tensor ``name`` for each key of ``keys`` in the
    table's rows file of ``checkpoint``, and re-seal the manifest (sizes, SHA-256): a
    checkpoint that an earlier dynemb's save wrote, with rows it then refused to load."""
    manifest = json.loads((checkpoint / files.MANIFEST).read_text())
    entry = next(f for f in manifest["tables"][table]["files"] if f["role"] == "rows")
    path = checkpoint / entry["path"]
    tensors = load_file(path)
    for key, (name, col, value) in keys.items():
        tensors[name][(tensors["keys"] == key).nonzero().item(), col] = value
    save_file(tensors, path)
    entry["bytes"], entry["sha256"] = path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()
    data = json.dumps(manifest).encode()
    (checkpoint / files.MANIFEST).write_bytes(data)
    (checkpoint / files.MANIFEST_SHA).write_bytes(f"{hashlib.sha256(data).hexdigest()}  {files.MANIFEST}\n".encode())


def _patched(contents: dict[str, torch.Tensor], table: str, keys: dict[int, tuple[str, int, float]]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in contents.items()}
    for key, (name, col, value) in keys.items():
        out[f"{table}/{name}"][(out[f"{table}/keys"] == key).nonzero().item(), col] = value
    return out


def test_a_checkpoint_from_before_with_nonfinite_rows_and_its_delta_load(tmp_path, capsys):
    """The compatibility checkpoint (written at 6ca4fdc, whose load refused non-finite rows) with
    NaN / inf put into its base: the base and the delta on it load with a warning naming the
    keys, bit for bit otherwise; a row the delta replaced no longer warns."""
    shutil.copytree(COMPAT / "ckpt", tmp_path / "ckpt")
    base, delta = tmp_path / "ckpt" / "base", tmp_path / "ckpt" / "delta"
    base_keys = load_file(base / "tables/seq/rows-000000.safetensors")["keys"]
    delta_keys = load_file(delta / "tables/seq/rows-000000.safetensors")["keys"]
    tombstones = load_file(delta / "tables/seq/tombstones-000000.safetensors")["keys"]
    kept = base_keys[~torch.isin(base_keys, torch.cat([delta_keys, tombstones]))]
    rewritten = base_keys[torch.isin(base_keys, delta_keys)]
    # One key the delta leaves alone (inf embedding), one it rewrites (NaN optimizer state).
    keep_key, rewritten_key = int(kept[0]), int(rewritten[0])
    patch = {keep_key: ("embeddings", 1, float("inf")), rewritten_key: ("optimizer_state", 0, float("nan"))}
    _patch_rows(base, "seq", patch)

    model = CompatModel()
    with pytest.warns(RuntimeWarning, match=r"table 'seq' .*: the rows of 2 key\(s\)") as caught:
        dynemb.checkpoint.load(model, base)
    assert {keep_key, rewritten_key} <= {k for w in caught for k in _keys_named(str(w.message))}
    assert_same(flat(model_contents(model)), _patched(load_file(COMPAT / "contents_base.safetensors"), "seq", patch))

    model = CompatModel()
    with pytest.warns(RuntimeWarning, match=rf"table 'seq' .*: the rows of 1 key\(s\) \[{keep_key}\]"):
        dynemb.checkpoint.load(model, delta)
    assert_same(flat(model_contents(model)), _patched(load_file(COMPAT / "contents_delta.safetensors"), "seq", {keep_key: patch[keep_key]}))

    # verify agrees with load: the chain is sound, the rows are reported.
    capsys.readouterr()
    assert main(["verify", str(delta)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {delta}: 2 checkpoint(s)") and "2 of them hold NaN or inf" in out


def test_verify_accepts_what_save_wrote(tmp_path, capsys):
    table = build()
    table.insert(torch.tensor([9]), torch.full((1, D), BIG))
    step(table, [1, 9], big=9)
    with pytest.warns(RuntimeWarning):
        dynemb.checkpoint.save(table, tmp_path / "ck")
    assert main(["verify", str(tmp_path / "ck")]) == 0
    assert "2 rows (1 of them hold NaN or inf" in capsys.readouterr().out


def _keys_named(message: str) -> list[int]:
    return [int(k) for k in message.split("[", 1)[1].split("]", 1)[0].split(",") if k.strip()]
