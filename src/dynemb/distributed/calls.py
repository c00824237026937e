"""What a collective call of a sharded table is, as the ranks compare it before any data moves.

Every call of a sharded engine opens with a header that all ranks exchange (folded into the
all-to-all of the call's counts, so it costs no collective of its own): the user-level operation
(``OPS``), the engine exchange (:class:`Kind`) with the flags that decide which collectives
follow, the table (an id given at ``shard()``, the same on every rank), the call's sequence
number, and whether the rank is fit to go on. The header has a fixed size, so a mismatch can
never make gloo receive data of the wrong size; the ranks raise instead (docs/design/0019).
"""

from __future__ import annotations

import dataclasses
import enum

# User-level operations of a sharded module (index = code in the header; "" = an engine called
# directly, outside any module operation).
OPS: tuple[str, ...] = ("", "forward", "backward", "optimizer.step()", "find() / contains()", "insert()", "erase()")

# Flags of a call: each changes which collectives the call makes, so they must agree.
TRAIN = 1  # a lookup that inserts (sends the key counts too)
SCORES = 2  # a lookup with caller-given scores (sends them)
RAISE_NONFINITE = 4  # a gradient step with nonfinite_grads="raise" (one more all-reduce)


class Kind(enum.IntEnum):
    """The exchange a call makes (its collectives, in order, are fixed by the kind and flags)."""

    REFUSED = 0  # the rank raised before its first collective; it only says so
    LOOKUP = 1
    FIND = 2
    GRADIENTS = 3
    PENDING = 4
    WRITE_ROWS = 5
    ERASE = 6
    INPUT_CHECK = 7
    OBJECTS = 8
    ROWS_TO_OWNERS = 9

    def describe(self, flags: int) -> str:
        """What the exchange does, in words (for error messages)."""
        if self is Kind.LOOKUP:
            return ("training" if flags & TRAIN else "eval") + " lookup" + (" with scores" if flags & SCORES else "")
        if self in (Kind.GRADIENTS, Kind.PENDING) and flags & RAISE_NONFINITE:
            return f"{_WORDS[self]}, nonfinite_grads='raise'"
        return _WORDS[self]

    @property
    def default_op(self) -> str:
        """The operation to name when no module operation is under way."""
        return _DEFAULT_OPS[self]


_WORDS = {
    Kind.REFUSED: "raised before its first collective",
    Kind.LOOKUP: "lookup",
    Kind.FIND: "find",
    Kind.GRADIENTS: "gradient step",
    Kind.PENDING: "pending-gradient step",
    Kind.WRITE_ROWS: "row write",
    Kind.ERASE: "erase",
    Kind.INPUT_CHECK: "input check",
    Kind.OBJECTS: "object exchange",
    Kind.ROWS_TO_OWNERS: "rows to their owners",
}
_DEFAULT_OPS = {
    Kind.REFUSED: "a call",
    Kind.LOOKUP: "forward",
    Kind.FIND: "find()",
    Kind.GRADIENTS: "backward",
    Kind.PENDING: "optimizer.step()",
    Kind.WRITE_ROWS: "insert()",
    Kind.ERASE: "erase()",
    Kind.INPUT_CHECK: "insert() / erase()",
    Kind.OBJECTS: "a dynemb.checkpoint save / load exchange",
    Kind.ROWS_TO_OWNERS: "a dynemb.checkpoint DCP load",
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective call: its exchange, the engine it is for (-1: none) and its flags."""

    kind: Kind
    engine: int = -1
    flags: int = 0
