"""TorchRec integration: the only dynemb package that imports torchrec.

``EmbeddingBagCollection`` / ``EmbeddingCollection`` are TorchRec's modules (subclasses, same
configs, same KeyedJaggedTensor in, same KeyedTensor / dict of JaggedTensor out) whose tables
are dynemb tables keyed by raw int64 ids; ``convert(model)`` swaps them into an existing model.
See docs/design/0012-torchrec.md.
"""

from dynemb.torchrec.convert import convert
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "convert"]
