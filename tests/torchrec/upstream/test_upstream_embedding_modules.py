"""TorchRec's own tests of its EmbeddingBagCollection / EmbeddingCollection, run on dynemb's.

``upstream_embedding_modules.py`` is TorchRec 1.8.0's
``torchrec/modules/tests/test_embedding_modules.py``, vendored unchanged (provenance in its
header). Its two test classes run here with ``dynemb.torchrec.EmbeddingBagCollection`` /
``EmbeddingCollection`` in place of TorchRec's (the names the upstream module looks up are
patched for each test; each test must build at least one dynemb module). Every upstream test
runs, except those listed below, each by name with its reason (docs/design/0029):

- skipped, TorchScript (out of scope): ``test_scripting`` of both classes scripts the eager
  module; dynemb's modules are not scriptable. ``test_fx`` of both classes runs whole, with its
  one ``torch.jit.script(gm)`` line made a no-op: the fx trace and the traced module's outputs
  are checked as upstream wrote them.
- expected differences (strict xfail): :data:`EXPECTED_DIFFERENCES`.
"""

from __future__ import annotations

import unittest
from unittest import mock

import pytest
import torch
import upstream_embedding_modules as upstream

import dynemb.torchrec

TORCHSCRIPT = "TorchScript: dynemb's EmbeddingBagCollection / EmbeddingCollection are not scriptable (issue 17 leaves TorchScript out)"
# Meta-device construction is issue 17 item 1 (another branch): these pass once a module built
# with device="meta" defers its tables; strict, so the marker must go when they do.
PENDING_META = "needs meta-device construction (issue 17 item 1): dynemb modules refuse device='meta' on this branch"
# Upstream test (class.method) -> why dynemb differs. Kept to what is inherent or pending.
EXPECTED_DIFFERENCES = {
    "EmbeddingBagCollectionTest.test_device": PENDING_META + "; then, inherent: the last check reads "
    "embedding_bags['t1'].weight.device == cpu, and dynemb has no dense weight: the per-table placeholder "
    "of shape [num_embeddings, D] is always a meta tensor (a real one would be real memory)",
    "EmbeddingBagCollectionTest.test_forward_with_meta_device": PENDING_META,
    "EmbeddingCollectionTest.test_device": PENDING_META,
}
SKIPPED = {
    "EmbeddingBagCollectionTest.test_scripting": TORCHSCRIPT,
    "EmbeddingCollectionTest.test_scripting": TORCHSCRIPT,
}


@pytest.fixture(autouse=True)
def dynemb_modules(monkeypatch, request):
    """The upstream module's EmbeddingBagCollection / EmbeddingCollection become dynemb's."""
    built = []

    def ebc(*args, **kwargs):
        built.append("ebc")
        return dynemb.torchrec.EmbeddingBagCollection(*args, **kwargs)

    def ec(*args, **kwargs):
        built.append("ec")
        return dynemb.torchrec.EmbeddingCollection(*args, **kwargs)

    monkeypatch.setattr(upstream, "EmbeddingBagCollection", ebc)
    monkeypatch.setattr(upstream, "EmbeddingCollection", ec)
    yield built
    if isinstance(request.instance, unittest.TestCase):
        assert built, "the upstream test built no dynemb module"


def _script_noop(module):
    return module


class TestEmbeddingBagCollection(upstream.EmbeddingBagCollectionTest):
    def test_fx(self) -> None:
        with mock.patch.object(torch.jit, "script", _script_noop):
            super().test_fx()

    @pytest.mark.skip(reason=SKIPPED["EmbeddingBagCollectionTest.test_scripting"])
    def test_scripting(self) -> None:
        super().test_scripting()

    @pytest.mark.xfail(strict=True, reason=EXPECTED_DIFFERENCES["EmbeddingBagCollectionTest.test_device"])
    def test_device(self) -> None:
        super().test_device()

    @pytest.mark.xfail(strict=True, reason=EXPECTED_DIFFERENCES["EmbeddingBagCollectionTest.test_forward_with_meta_device"])
    def test_forward_with_meta_device(self) -> None:
        super().test_forward_with_meta_device()


class TestEmbeddingCollection(upstream.EmbeddingCollectionTest):
    def test_fx(self) -> None:
        with mock.patch.object(torch.jit, "script", _script_noop):
            super().test_fx()

    @pytest.mark.skip(reason=SKIPPED["EmbeddingCollectionTest.test_scripting"])
    def test_scripting(self) -> None:
        super().test_scripting()

    @pytest.mark.xfail(strict=True, reason=EXPECTED_DIFFERENCES["EmbeddingCollectionTest.test_device"])
    def test_device(self) -> None:
        super().test_device()


def _upstream_tests(cls: type[unittest.TestCase]) -> set[str]:
    return {f"{cls.__name__}.{name}" for name in unittest.TestLoader().getTestCaseNames(cls)}


def test_every_exception_names_an_upstream_test():
    """A re-vendored file that renames or drops a test cannot leave a stale skip or xfail."""
    names = _upstream_tests(upstream.EmbeddingBagCollectionTest) | _upstream_tests(upstream.EmbeddingCollectionTest)
    assert set(SKIPPED) <= names and set(EXPECTED_DIFFERENCES) <= names
    assert not set(SKIPPED) & set(EXPECTED_DIFFERENCES)
    # 15 upstream tests: 2 skipped (TorchScript), 3 expected differences, 10 run as written.
    assert len(names) == 15
