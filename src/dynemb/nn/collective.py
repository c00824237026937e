"""Module operations that are collective calls when the module's tables are sharded."""

from __future__ import annotations

import functools
from collections.abc import Callable


def collective(op: str) -> Callable:
    """Decorate a method of a dynemb table or collection that is a collective call once its
    engines are sharded (``op``: its name, an entry of ``dynemb.distributed.calls.OPS``).

    On a sharded module the method runs inside the engine's ``collective_op``: if it raises on
    this rank before its first collective (bad input), the other ranks are told and raise too,
    instead of waiting for a collective this rank skips or exchanging data of another call; the
    module's ``step`` clock is put back when no call of the operation ended. Unsharded modules
    call the method as it is.
    """

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            engine = self.engines[0]
            if not engine.collective:
                return method(self, *args, **kwargs)
            step = self.step

            def undo():
                self.step = step

            with engine.collective_op(op, undo):
                return method(self, *args, **kwargs)

        return call

    return wrap
