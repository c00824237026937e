"""Input checks of the module operations, agreed by every rank of a sharded table first.

N keys given, D embedding dim, S optimizer state columns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynemb.table.index import check_keys


def as_ids(ids, name: str, device: torch.device) -> torch.Tensor:
    """Ids as an int64 tensor of their own shape on ``device``: tensors are checked, lists /
    tuples of ints converted; anything else raises TypeError naming the argument."""
    if isinstance(ids, (list, tuple)):
        try:
            ids = torch.as_tensor(ids, dtype=torch.int64, device=device)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise TypeError(f"{name} must be a tensor of int64 or a list of ints, got a list that torch cannot convert: {e}") from None
    return check_keys(ids, name, device).view(ids.shape)


def agreed_input(engine, what: str, check: Callable, fields: Callable) -> tuple:
    """``check()`` (which raises TypeError / ValueError on bad input) and, on a sharded
    (collective) engine, every rank's ``fields(checked)`` too: the ranks agree on their inputs
    before any collective, so a rank with bad input raises on every rank at once instead of
    leaving the others waiting. Returns (checked, every rank's fields or None)."""
    if not engine.collective:
        return check(), None
    try:
        checked, problem = check(), None
    except (TypeError, ValueError) as e:
        checked, problem = None, e
    peers = engine.agree(what, None if problem is None else f"{type(problem).__name__}: {problem}", **(fields(checked) if problem is None else {}))
    if problem is not None:
        raise problem
    return checked, peers


def agreed_insert(peers: list[dict] | None, values: torch.Tensor, given: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sharded insert's values and scores once the ranks agreed: every rank with keys must
    give the same values width and scores or no scores (the owners treat every rank's keys
    alike); a rank with no keys takes theirs. Raises the same error on every rank otherwise."""
    if peers is None:
        return values, given
    with_keys = [p for p in peers if p["n"]]
    for field, hint, among in (
        # The table decides which collectives run: every rank must name the same one.
        ("table", "every rank must insert into the same table (with no keys, too)", peers),
        ("width", "give every rank embeddings [N, D] or every rank whole rows [N, D+S]", with_keys),
        ("scores", "give scores on every rank or on none", with_keys),
    ):
        if len({p[field] for p in among}) > 1:
            per_rank = ", ".join(f"rank {r}: {p[field]!r}" for r, p in enumerate(peers) if p in among)
            raise ValueError(f"insert() on a sharded table: {field} differs between ranks ({per_rank}); {hint}")
    if values.shape[0] == 0 and with_keys:
        values = values.new_empty((0, with_keys[0]["width"]))
        given = values.new_empty(0, dtype=torch.int64) if with_keys[0]["scores"] else None
    return values, given


def checked_insert(engine, table: str | None, keys, values, scores, *, require_float: bool = False) -> tuple:
    """``insert()``'s input, checked (and on a sharded engine agreed by every rank, see
    :func:`agreed_input` / :func:`agreed_insert`): distinct keys [N], the inverse of the given
    order [N], each key's count [N] (ones), values [N, D] or [N, D+S] and scores [N] or None,
    in key order. Raises ValueError / TypeError naming the argument."""

    def check():
        flat = as_ids(keys, "keys", engine.device).reshape(-1)
        n = flat.numel()
        widths = (engine.embedding_dim, engine.width)
        if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.shape[0] != n or values.shape[1] not in widths:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"values.shape={shape}: must be [{n}, {widths[0]}] or [{n}, {widths[1]}]")
        if require_float and not values.is_floating_point():
            raise TypeError(f"values.dtype={values.dtype}: must be a floating point dtype")
        unique, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        if unique.numel() != n:
            raise ValueError(f"keys has {n - unique.numel()} duplicate(s): insert assigns one value per key")
        order = torch.empty_like(inverse).scatter_(0, inverse, torch.arange(n, device=engine.device))
        given = None
        if scores is not None:
            given = as_ids(scores, "scores", engine.device).reshape(-1)
            if given.numel() != n:
                raise ValueError(f"scores has {given.numel()} values for {n} keys")
            given = given.index_select(0, order)
        ordered = values.detach().to(device=engine.device, dtype=engine.dtype).index_select(0, order)
        # Checked in the table's dtype: a float64 value beyond its range arrives as inf.
        bad = ~torch.isfinite(ordered).all(1) if ordered.is_floating_point() else None
        if bad is not None and bool(bad.any()):
            shown = unique[bad][:8].tolist()
            raise ValueError(
                f"values: the rows of {int(bad.sum())} key(s) {shown}{' ...' if int(bad.sum()) > 8 else ''} hold NaN or inf "
                f"(in the table's dtype {engine.dtype}); insert refuses non-finite rows and changed nothing"
            )
        return unique, inverse, counts, ordered, given

    (unique, inverse, counts, ordered, given), peers = agreed_input(
        engine, "insert", check, lambda c: {"table": table, "n": c[0].numel(), "width": c[3].shape[1], "scores": c[4] is not None}
    )
    ordered, given = agreed_insert(peers, ordered, given)
    return unique, inverse, counts, ordered, given
