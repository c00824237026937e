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
    def parse(cls, value: "str | _StrEnum", field: str):
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
    """What a key's score means; the lowest-scored unlocked key of a full bucket is evicted.

    ============  ===========================================  ==================================
    strategy      score of a key                               on a full bucket
    ============  ===========================================  ==================================
    timestamp     wall-clock ns of its last training use       evict the least recently used key
                  (strictly increasing per table)
    step          table step (one per training forward) of     evict the key unused for the most
                  its last training use                        steps
    lfu           number of times it was looked up in          evict the least frequent key; a new
                  training (duplicates in a batch count)       key only replaces one that is not
                                                               more frequent than itself
    customized    the value the caller gives                   evict the lowest given score; a new
                  (``scores=`` or ``set_score``)               key only replaces a key whose score
                                                               is not higher than its own
    no_eviction   table step of its last training use          nothing is evicted: the key fails
                                                               (see CheckMode)
    ============  ===========================================  ==================================

    Ties: among equal scores the key in the lower slot of the bucket is evicted first; among new
    keys competing for one bucket the higher score wins, then the smaller key. A key looked up in
    the current batch is never evicted by that batch.
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
