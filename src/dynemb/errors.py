"""Exceptions raised by dynemb."""

from __future__ import annotations


class InsertionError(RuntimeError):
    """Keys could not be placed in a table and the table's check mode is ``raise``.

    Attributes:
        failed_keys (Tensor[int64]): [F] the keys that were not inserted.
    """

    def __init__(self, message: str, failed_keys):
        super().__init__(message)
        self.failed_keys = failed_keys
