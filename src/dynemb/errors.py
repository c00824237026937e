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


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded (or a delta cannot be written): a file is missing, extra,
    truncated, corrupted or inconsistent with the manifest, the format version is unknown, or
    the checkpoint does not fit the model. Raised before any table changes.

    Attributes:
        path (str | None): the file or directory concerned.
        problem (str): what is wrong with it.
    """

    def __init__(self, problem: str, path=None):
        super().__init__(f"{path}: {problem}" if path is not None else problem)
        self.path = None if path is None else str(path)
        self.problem = problem
