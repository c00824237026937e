"""Enums shared by every layer, and the shape legend.

Shape legend used in docstrings and shape comments across dynemb:
    N   keys (ids) in a batch, duplicates included
    U   unique keys in a batch
    M   keys being placed (new keys) in one insert
    O   new keys that overflow their bucket
    D   embedding dim
    S   optimizer state columns per row
    B   buckets in the key index
    W   slots per bucket (bucket capacity)
    C   capacity (rows)
"""

from __future__ import annotations

import enum


class _StrEnum(str, enum.Enum):
    @classmethod
    def parse(cls, value: str | _StrEnum, field: str):
        """Return the member for ``value`` (a member or its string), or raise naming ``field``."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{field}={value!r} is not one of {choices}") from None

    def __str__(self) -> str:
        return self.value


class ScoreStrategy(_StrEnum):
    """What a key's score means, and which key makes room for a new one.

    A new key goes to a free slot of its two candidate buckets; below its capacity the table
    grows instead of evicting; at capacity, keys of full buckets first move to their other
    bucket to free a slot. Only then is the lowest-scored unlocked key of the new key's 2W
    candidate slots evicted, by the rule below. The clock ``now`` is the caller's (a step or a
    timestamp); the index never reads wall time. A module's timestamp is whole seconds since
    2025-01-01 UTC, one value per training call and strictly rising (:mod:`dynemb.nn.clock`).

    ============  ===========================================  ====================================
    strategy      score of a key                               when no slot can be freed
    ============  ===========================================  ====================================
    timestamp     ``now`` (a timestamp) of its last use        evict the least recently used key
                                                               if its score is not above ``now``
    step          ``now`` (the training step) of its           evict the key unused for the most
                  last use                                     steps, as for timestamp
    lfu           number of times it was looked up             evict the least frequent key,
                  (duplicates in a batch count;                whatever the new key's count (an
                  saturating at the int64 maximum)             LFU cache): fails only if every
                                                               candidate is used by the batch
    customized    the value the caller gives (``scores=``)     evict the lowest given score; a new
                                                               key only replaces a key whose score
                                                               is not higher than its own
    no_eviction   ``now`` of its last use                      nothing is evicted: the key fails
                                                               (and is reported, see CheckMode)
    ============  ===========================================  ====================================

    Ties: among equal scores the key in the first candidate bucket, then in the lower slot, is
    evicted first; among new keys competing for one bucket the higher score wins, then the
    smaller key. A key looked up in the current batch is never evicted by that batch. Scores
    given by the caller (``scores=``) are assigned under every strategy.
    """

    TIMESTAMP = "timestamp"
    STEP = "step"
    LFU = "lfu"
    CUSTOMIZED = "customized"
    NO_EVICTION = "no_eviction"


class CheckMode(_StrEnum):
    """What happens when keys cannot be placed (their bucket is full of keys worth more to it).

    In every mode the failures are counted in ``stats()["failed_inserts"]`` and the keys of the
    last failing call are available as ``last_failed_keys``.

    * ``raise``: raise :class:`dynemb.InsertionError` naming how many keys failed (default).
    * ``warn``: emit a ``RuntimeWarning`` and continue; failed keys get their initial value.
    * ``count``: only count.
    """

    RAISE = "raise"
    WARN = "warn"
    COUNT = "count"


class PoolingMode(_StrEnum):
    """How a bag of ids becomes one vector (torch.nn.EmbeddingBag's ``mode``); ``none`` = sequence."""

    SUM = "sum"
    MEAN = "mean"
    NONE = "none"


class InitKind(_StrEnum):
    """Initial distribution of a new key's embedding."""

    UNIFORM = "uniform"
    NORMAL = "normal"
    TRUNCATED_NORMAL = "truncated_normal"
    CONSTANT = "constant"


class NonFiniteGrads(_StrEnum):
    """What backward does with a key whose summed gradient holds NaN or inf.

    * ``skip``: the key's row and optimizer state are left as they were; ``stats()
      ["nonfinite_grads"]`` counts the key (default).
    * ``raise``: raise ``FloatingPointError`` naming the keys, before any row of the batch changes.
    * ``apply``: update as for any gradient (the row becomes non-finite).
    """

    SKIP = "skip"
    RAISE = "raise"
    APPLY = "apply"


class Backend(_StrEnum):
    """Which kernels run a CPU table's hot loops (docs/design/0037-native-kernels.md).

    * ``auto``: dynemb's compiled kernels where they build (a warning, once, where they do not);
      the environment variable ``DYNEMB_BACKEND`` (``torch`` or ``native``) decides for "auto"
      (default).
    * ``native``: the compiled kernels; raises where they cannot be built.
    * ``torch``: plain torch (the oracle every kernel is tested against).

    Tables on other devices run plain torch under every backend.
    """

    AUTO = "auto"
    NATIVE = "native"
    TORCH = "torch"


class UpdateMode(_StrEnum):
    """When a table's optimizer changes its rows (docs/design/0011-deferred-updates.md).

    * ``fused``: backward applies one optimizer step per lookup at once (default).
    * ``deferred``: backward sums the gradient per key across backward calls; the table's
      ``dynemb.optim`` optimizer applies one step with the sum at ``optimizer.step()``, and
      ``optimizer.zero_grad()`` drops it. Gradient accumulation, clipping
      (:func:`dynemb.clip_grad_norm_`) and ``torch.amp.GradScaler`` work as for dense parameters.
    """

    FUSED = "fused"
    DEFERRED = "deferred"
