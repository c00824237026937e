"""DynamicTable: the torch module around one table engine, and the table's policy.

N ids in a batch, U unique ids, E keys leaving, D embedding dim, S optimizer state columns,
K keys held, P keys with a pending (deferred) gradient.

Forward: de-duplicate ids -> resolve (insert in training, subject to admission) -> gather rows
[U, D+S] -> embeddings [U, D], which torch's own embedding / embedding_bag expand and pool.
Backward: torch reduces the output gradient to one [U, D] gradient per unique key; the engine's
fused optimizer updates those rows (``update="fused"``), or the table adds it to its pending
gradient [P, D], applied at ``optimizer.step()`` (``update="deferred"``, see
docs/design/0011-deferred-updates.md). This layer owns the policy: check mode, admission, eval
defaults, reporting of keys that fail or leave (``last_failed_keys``, ``last_evicted_keys``,
evict hooks), the clock, thread safety (one lock per table) and the state_dict.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from dynemb.config import TableConfig
from dynemb.errors import InsertionError
from dynemb.nn.admission import FrequencyAdmission
from dynemb.nn.autograd import FusedEmbeddings, FusedSequence, Lookup
from dynemb.nn.collective import collective
from dynemb.nn.deferred import GradAccumulator
from dynemb.nn.functional import Resolved, TableEngine
from dynemb.nn.moves import conversion_target
from dynemb.optim.base import RowOptimizer
from dynemb.storage.base import RowStore
from dynemb.table.index import check_keys
from dynemb.types import CheckMode, ScoreStrategy, UpdateMode
from dynemb.workspace import Workspace, writable

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
EvictHook = Callable[[torch.Tensor, dict], None]

# state_dict entries (see docs/design/0009-state-dict.md); index.* and admission.* are the key
# index's own state.
_TABLE_ENTRIES = ("keys", "embeddings", "optimizer_state", "scores", "step", "optimizer_step", "last_timestamp", "counters", "generator_state")
_INDEX_ENTRIES = ("rows", "slots", "num_buckets", "bucket_capacity", "max_buckets", "free_high_water", "free", "counters")
_ADMISSION_ENTRIES = (
    "keys",
    "rows",
    "scores",
    "slots",
    "num_buckets",
    "bucket_capacity",
    "max_buckets",
    "free_high_water",
    "free",
    "counters",
    "counts",
    "rejections",
)


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
    if not getattr(engine, "collective", False):
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


def load_own_entries(module, expected: list[str], load, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    """``_load_from_state_dict`` of a module whose state is entries of its own (no children):
    collect ``expected`` under ``prefix``, report missing / unexpected ones as torch does, and
    call ``load(entries)``, turning its ValueError into an error message (nothing changed)."""
    present = {name: state_dict[prefix + name] for name in expected if prefix + name in state_dict}
    missing = [prefix + name for name in expected if name not in present]
    missing_keys.extend(missing)
    if strict:
        known = set(expected)
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in known)
    if missing:
        error_msgs.append(f"{type(module).__name__} at '{prefix}': missing entries {missing}; it was not changed")
        return
    try:
        load(present)
    except ValueError as e:
        error_msgs.append(f"{type(module).__name__} at '{prefix}': {e}; it was not changed")


class DynamicTable(torch.nn.Module):
    """A dynamic embedding table: int64 keys -> rows of embedding and optimizer state.

    Args:
        config: the table's :class:`dynemb.TableConfig`.
        optimizer: row-wise optimizer (``dynemb.optim``); ``None`` makes the table frozen (its
            outputs do not require grad).
        store: optional row store (a :class:`dynemb.storage.base.RowStore`); default: rows in
            one tensor on ``config.device``.
        update: ``"fused"`` (default): each backward applies one optimizer step at once;
            ``"deferred"``: backward sums the gradient per key, ``optimizer.step()`` applies one
            step with the sum and ``optimizer.zero_grad()`` drops it (needs an optimizer). See
            :class:`dynemb.types.UpdateMode`.

    Training-mode lookups insert missing keys (subject to admission); eval-mode lookups never
    insert and give ``eval_default`` for missing keys. As with BatchNorm's running statistics,
    the module's mode decides, not the grad mode: a training-mode lookup under ``torch.no_grad()``
    or ``torch.inference_mode()`` inserts keys and advances the step, but updates no row. Keys
    that are not in the table in training (not admitted, or failed) get their initial value and
    are not trained.

    Every public method is safe to call from several threads: one lock per table serialises
    them (docs/design/0008-threading.md).
    """

    def __init__(
        self,
        config: TableConfig,
        optimizer: RowOptimizer | None = None,
        store: RowStore | None = None,
        *,
        update: UpdateMode | str = UpdateMode.FUSED,
    ):
        super().__init__()
        if optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise TypeError(f"optimizer={optimizer!r}: must be a dynemb.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam) or None")
        self.update_mode = UpdateMode.parse(update, "update")
        if self.update_mode is UpdateMode.DEFERRED and optimizer is None:
            raise ValueError("update='deferred' needs an optimizer: optimizer.step() applies the accumulated gradient")
        self.engine = TableEngine(config, optimizer, store)
        self.admission = FrequencyAdmission(config.admission, config.device) if config.admission else None
        self.embedding_dim = config.embedding_dim
        self.state_dim = self.engine.state_dim
        self.step = 0
        self.custom_score: int | None = None
        self._last_timestamp = 0
        self._lock = threading.RLock()
        self._evict_hooks: collections.OrderedDict[int, EvictHook] = collections.OrderedDict()
        self._workspace = Workspace(config.device)
        self._erased = 0
        self.last_failed_keys = torch.empty(0, dtype=torch.int64, device=config.device)
        self.last_evicted_keys = torch.empty(0, dtype=torch.int64, device=config.device)
        # The pending gradient of a deferred table (None when fused); registered with the optimizer.
        self._pending: GradAccumulator | None = None
        if self.update_mode is UpdateMode.DEFERRED:
            self._pending = GradAccumulator(config.embedding_dim, config.dtype, config.device)
            optimizer.register_deferred(self, self._pending.param)

    @property
    def config(self) -> TableConfig:
        return self.engine.config

    @property
    def optimizer(self) -> RowOptimizer | None:
        return self.engine.optimizer

    @property
    def device(self) -> torch.device:
        return self.engine.config.device

    @property
    def index(self):
        return self.engine.index

    @property
    def store(self) -> RowStore:
        return self.engine.store

    @property
    def optimizer_step(self) -> int:
        return self.engine.optimizer_step

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"embedding_dim={c.embedding_dim}, capacity={self.index.capacity()}, "
            f"score_strategy='{c.score_strategy}', optimizer={self.optimizer!r}, update='{self.update_mode}', device='{c.device}'"
        )

    def set_score(self, score: int) -> None:
        """Score given to keys used from now on (``customized`` strategy only; an int64)."""
        if self.index.strategy is not ScoreStrategy.CUSTOMIZED:
            raise ValueError(f"set_score needs score_strategy='customized', this table uses '{self.index.strategy}'")
        if not isinstance(score, int) or isinstance(score, bool) or not _INT64_MIN <= score <= _INT64_MAX:
            raise ValueError(f"score={score!r}: must be an int in the int64 range [-2**63, 2**63 - 1]")
        self.custom_score = score

    def register_evict_hook(self, fn: EvictHook) -> RemovableHandle:
        """Call ``fn(keys, rows)`` for every key that leaves the table (evicted or erased).

        ``keys`` (Tensor[int64]) [E]; ``rows`` a dict of ``embeddings`` [E, D],
        ``optimizer_state`` [E, S] and ``scores`` [E] (int64) as they were when the keys left.
        Hooks run in registration order, inside the call that evicts (under the table's lock),
        before a failed insert is raised. Returns a handle whose ``remove()`` unregisters ``fn``.
        """
        if not callable(fn):
            raise TypeError(f"fn={fn!r}: must be callable as fn(keys, rows)")
        handle = RemovableHandle(self._evict_hooks)
        self._evict_hooks[handle.id] = fn
        return handle

    # -- clock, ids, reporting ---------------------------------------------------------------

    def _now(self) -> int:
        """The clock for the index: a strictly increasing timestamp (ns) or the step."""
        if self.index.strategy is ScoreStrategy.TIMESTAMP:
            self._last_timestamp = max(time.time_ns(), self._last_timestamp + 1)
            return self._last_timestamp
        return self.step

    def _ids(self, ids, name: str = "ids") -> torch.Tensor:
        return as_ids(ids, name, self.device)

    def _given_scores(self, n: int) -> torch.Tensor | None:
        if self.index.strategy is not ScoreStrategy.CUSTOMIZED:
            return None
        if self.custom_score is None:
            raise ValueError("score_strategy='customized': call set_score(score) before training lookups")
        return torch.full((n,), self.custom_score, dtype=torch.int64, device=self.device)

    def _report(self, failed: torch.Tensor, evicted_keys: torch.Tensor, evicted: dict | None, total: int) -> None:
        """The one exit of keys that leave or fail: record them, run evict hooks, apply check mode."""
        self.last_failed_keys = failed
        self.last_evicted_keys = evicted_keys
        if evicted is not None:
            for fn in list(self._evict_hooks.values()):
                fn(evicted_keys, evicted)
        if failed.numel() == 0 or self.config.check_mode is CheckMode.COUNT:
            return
        where = ""
        if getattr(self.engine, "collective", False):
            where = " of this rank's shard; the keys were refused by the shards that own them, which count them in their stats()"
        message = (
            f"{failed.numel()} of {total} keys could not be inserted: both their buckets hold "
            f"only keys used in this batch or scored higher (score_strategy='{self.index.strategy}', "
            f"size={self.index.size()}, capacity={self.index.capacity()}{where}). Increase capacity, or set "
            "check_mode='warn' or 'count' to continue; failed keys get their initial value and are "
            "not trained."
        )
        if self.config.check_mode is CheckMode.RAISE:
            raise InsertionError(message + " The keys are on this exception's .failed_keys.", failed)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _resolve_train(self, keys: torch.Tensor, counts: torch.Tensor, *, scores=None, admit: bool = True, **kw) -> Resolved:
        """Insert (subject to admission unless ``admit=False``) and return the resolution of
        unique keys [U]; failures and evictions are not reported yet."""
        given = scores if scores is not None else self._given_scores(keys.numel())
        insertable = None
        if admit and self.admission is not None:
            _, found = self.index.find(keys)
            missing = (~found).nonzero().squeeze(1)
            insertable = torch.zeros_like(found)
            if missing.numel():
                insertable.index_copy_(0, missing, self.admission.admit(keys[missing], counts[missing], self.step))
        r = self.engine.resolve(
            keys,
            train=True,
            now=self._now(),
            counts=counts,
            insertable=insertable,
            scores=given,
            evicted_contents=bool(self._evict_hooks),
            **kw,
        )
        if self.admission is not None:
            self.admission.forget(keys[r.inserted])
        return r

    # -- lookups -----------------------------------------------------------------------------

    def _gather(self, ids) -> tuple[Lookup, torch.Tensor]:
        """De-duplicate ids, resolve them (inserting in training) and gather their rows.

        Returns the lookup (unique keys [U], rows [U], rows data [U, D+S]) and the inverse ([*],
        ids' shape) of each id into the unique keys.
        """
        ids = self._ids(ids)
        if self.training and self.optimizer is not None and torch.is_grad_enabled():
            # Refused before the step changes anything (Adam on float16 rows, docs/design/0021).
            self.optimizer.check_row_dtype(self.config.dtype)
        with self._lock:
            flat = ids.reshape(-1)
            keys, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
            D = self.embedding_dim
            if self.training:
                self.step += 1
                r = self._resolve_train(keys, counts)
            else:
                r = self.engine.resolve(keys, train=False, now=None)
            ok = r.ok
            data = self.engine.gather(r.rows)  # [U, D+S]
            missing = (~ok).nonzero().squeeze(1)
            if missing.numel():
                if self.training:
                    fill = self.engine.initializer(keys.index_select(0, missing))
                else:
                    fill = torch.full((missing.numel(), D), self.config.eval_default, dtype=data.dtype, device=self.device)
                data[:, :D].index_copy_(0, missing, fill)
            lookup = Lookup(self, keys, r.rows, data, self.engine.version, repeatable=self._pending is not None)
            if self.training:
                self._report(r.failed_keys, r.evicted_keys, r.evicted, keys.numel())
        return lookup, inverse.view(ids.shape)

    def _trains(self) -> bool:
        return self.training and self.optimizer is not None and torch.is_grad_enabled()

    @collective("forward")
    def lookup(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of the unique ids and how to expand them.

        Args:
            ids (Tensor[int64]): [*] any shape.
        Returns:
            embeddings (Tensor): [U, D], requiring grad when training with an optimizer.
            inverse (Tensor[int64]): [*] (ids' shape) index of each id into ``embeddings``.
        """
        lookup, inverse = self._gather(ids)
        if self._trains():
            trigger = torch.empty(0, device=self.device, requires_grad=True)
            return FusedEmbeddings.apply(trigger, lookup, self.embedding_dim), inverse
        return lookup.data[:, : self.embedding_dim], inverse

    @collective("forward")
    def lookup_sequence(self, ids) -> torch.Tensor:
        """One embedding per id: ids [*] -> [*, D]; in training, backward updates the rows."""
        lookup, inverse = self._gather(ids)
        if self._trains():
            trigger = torch.empty(0, device=self.device, requires_grad=True)
            return FusedSequence.apply(trigger, lookup, inverse, self.embedding_dim)
        return F.embedding(inverse, lookup.data[:, : self.embedding_dim])

    @collective("backward")
    def _apply_lookup_gradients(self, lookup: Lookup, grad_u, inverse, grad) -> None:
        """Backward of one lookup: sum per key if needed, then one fused optimizer step (or add
        to the pending gradient when deferred)."""
        with self._lock:
            if grad_u is None:
                # Summed into a buffer kept between steps (a fresh [U, D] page-faults on CPU); the
                # engine (or the accumulator) consumes it before the lock is released.
                buf = self._workspace.get("grad", lookup.keys.numel(), (self.embedding_dim,), grad.dtype)
                grad_u = buf.zero_().index_add_(0, inverse, grad)
            if self._pending is not None:
                self._accumulate(lookup, grad_u)
                return
            self.engine.apply_gradients(
                lookup.keys,
                lookup.rows,
                grad_u,
                data=lookup.data,
                version=lookup.version,
                nonfinite=self.config.nonfinite_grads,
            )

    # -- deferred updates (the DeferredOwner protocol of dynemb.optim.base) -----------------

    def _accumulate(self, lookup: Lookup, grad_u: torch.Tensor) -> None:
        """Add a lookup's per-key gradient [U, D] to the pending one (under the lock)."""
        keys = lookup.keys
        ok = lookup.rows >= 0
        # Keys that were not in the table at the lookup (not admitted, failed) are not trained,
        # as with the fused update; one host sync, as the fused update's.
        if not bool(ok.all()):
            sel = ok.nonzero().squeeze(1)
            keys, grad_u = keys.index_select(0, sel), grad_u.index_select(0, sel)
        self._pending.add(keys, grad_u)

    @collective("optimizer.step()")
    def _deferred_apply(self) -> None:
        """One optimizer step on the rows of the pending keys with their summed gradient, then
        clear it; keys evicted or erased since their lookup are skipped. Nothing (not even a step
        count) when nothing is pending. Called by ``optimizer.step()``."""
        with self._lock:
            if self._pending is None:
                return
            # Raises before any row changes with nonfinite_grads="raise": the gradient stays pending.
            self.engine.apply_pending(self._pending.keys, self._pending.grad, nonfinite=self.config.nonfinite_grads)
            self._pending.clear()

    def _deferred_clear(self) -> None:
        """Drop the pending gradient. Called by ``optimizer.zero_grad()``."""
        with self._lock:
            if self._pending is not None:
                self._pending.clear()

    def _deferred_grad(self) -> torch.Tensor | None:
        """The pending gradient [P, D] (the live tensor: scaling it in place scales the next
        step), or None for a fused table."""
        with self._lock:
            return None if self._pending is None else self._pending.grad

    def pending_keys(self) -> torch.Tensor:
        """Tensor[int64]: [P] keys with a pending (deferred) gradient, sorted; empty when fused."""
        with self._lock:
            if self._pending is None:
                return torch.empty(0, dtype=torch.int64, device=self.device)
            return self._pending.keys.clone()

    # -- direct access -----------------------------------------------------------------------

    @collective("find() / contains()")
    def find(self, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of keys without side effects.

        Args:
            keys (Tensor[int64]): [*] any shape.
        Returns:
            values (Tensor): [*, D], ``eval_default`` where missing.
            found (Tensor[bool]): [*]
        """
        keys = self._ids(keys, "keys")
        with self._lock:
            rows, found = self.engine.find(keys.reshape(-1))
            values = self.engine.gather(rows)[:, : self.embedding_dim]
        values.masked_fill_(~found[:, None], self.config.eval_default)
        return values.view(*keys.shape, self.embedding_dim), found.view(keys.shape)

    @collective("find() / contains()")
    def contains(self, keys) -> torch.Tensor:
        """Membership without side effects: keys (Tensor[int64]) [*] -> Tensor[bool] [*]."""
        keys = self._ids(keys, "keys")
        with self._lock:
            return self.engine.find(keys.reshape(-1))[1].view(keys.shape)

    def __contains__(self, key) -> bool:
        """``key in table`` for one key (an int or a one-element tensor); use :meth:`contains`
        for a batch (Python turns ``in`` into a single bool)."""
        if isinstance(key, torch.Tensor) and key.numel() != 1:
            raise TypeError(f"`key in table` takes one key, got a tensor of {key.numel()}; use table.contains(keys) for a batch")
        if not isinstance(key, (int, torch.Tensor)) or isinstance(key, bool):
            raise TypeError(f"key={key!r}: must be an int or a one-element int64 tensor")
        return bool(self.contains(torch.as_tensor([key], device=self.device).reshape(1) if isinstance(key, int) else key.reshape(1)))

    def __len__(self) -> int:
        return self.index.size()

    @collective("insert()")
    def insert(self, keys, values: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Assign rows to keys, inserting missing ones (warm start, restore from ``export()``).

        Args:
            keys (Tensor[int64]): [N] distinct keys.
            values (Tensor): [N, D] embeddings (optimizer state kept for existing keys, initial
                for new ones) or [N, D+S] whole rows including optimizer state.
            scores (Tensor[int64] | None): [N] scores to assign; default: the strategy's.
        Returns:
            Tensor[bool]: [N] the key is in the table now (see check_mode for failures).
        """
        unique, inverse, counts, values, given = checked_insert(self.engine, None, keys, values, scores, require_float=True)
        n = unique.numel()
        with self._lock, writable():
            # A warm start bypasses admission: the caller decides which keys belong.
            r = self._resolve_train(unique, counts, scores=given, admit=False, init_rows=values.shape[1] != self.engine.width)
            ok = r.ok.nonzero().squeeze(1)
            self.engine.write_rows(unique.index_select(0, ok), r.rows.index_select(0, ok), values.index_select(0, ok))
            # Keys that did fit hold the caller's values before a failure is raised.
            self._report(r.failed_keys, r.evicted_keys, r.evicted, n)
        return r.ok.index_select(0, inverse)

    @collective("erase()")
    def erase(self, keys) -> torch.Tensor:
        """Remove keys ([*] int64) and free their rows; returns found ([*] bool). Erased keys
        leave through the same exit as evicted ones (``last_evicted_keys``, evict hooks)."""
        keys, _ = agreed_input(self.engine, "erase", lambda: self._ids(keys, "keys"), lambda k: {})
        with self._lock:
            r, contents = self.engine.erase(keys.reshape(-1), evicted_contents=bool(self._evict_hooks))
            self._erased += r.evicted_keys.numel()
            self._report(r.evicted_keys.new_empty(0), r.evicted_keys, contents, keys.numel())
        return r.found.view(keys.shape)

    def export(self, chunk_size: int = 1 << 16) -> Iterator[dict[str, torch.Tensor]]:
        """Yield every key with its row, in chunks: dicts of ``keys`` [K] int64, ``embeddings``
        [K, D], ``optimizer_state`` [K, S], ``scores`` [K] int64.

        Each chunk is read under the table's lock; if the table changes between chunks the
        iterator raises RuntimeError instead of yielding an inconsistent mix.
        """
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r}: must be an int >= 1")
        with self._lock:
            version = self.engine.version
            chunks = self.engine.export(chunk_size)
        while True:
            with self._lock:
                if self.engine.version != version:
                    raise RuntimeError("the table changed while export() was iterating; export again")
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield chunk

    # -- introspection -----------------------------------------------------------------------

    def size(self) -> int:
        """Keys held."""
        return self.index.size()

    def capacity(self) -> int:
        """Most keys held (the configured capacity rounded up to whole buckets, at most 2x)."""
        return self.index.capacity()

    def load_factor(self) -> float:
        """size / currently allocated capacity."""
        return self.index.load_factor()

    def stats(self) -> dict[str, int | float]:
        """size, capacity (real, after rounding), requested_capacity, current_capacity,
        load_factor, inserts, evictions, erased, failed_inserts, admission_rejections, growths,
        nonfinite_grads, step, optimizer_step, pending_grad_keys (deferred: keys whose gradient
        waits for ``optimizer.step()``), scratch_bytes."""
        with self._lock:
            s = self.index.stats()
            s["requested_capacity"] = self.config.capacity
            s["erased"] = self._erased
            s["admission_rejections"] = self.admission.rejections if self.admission else 0
            s["nonfinite_grads"] = self.engine.nonfinite_grads
            s["step"] = self.step
            s["optimizer_step"] = self.engine.optimizer_step
            s["pending_grad_keys"] = len(self._pending) if self._pending is not None else 0
            pending_bytes = self._pending.nbytes() if self._pending is not None else 0
            s["scratch_bytes"] = self._workspace.nbytes() + self.engine._workspace.nbytes() + pending_bytes
        return s

    # -- torch.nn.Module behaviour -----------------------------------------------------------

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.double()``... move or convert the
        whole table: rows (embeddings and optimizer state, docs/design/0021-dtype-moves.md),
        index, admission counters, pending gradient and buffers."""
        # Checked first: a dtype no table holds raises before anything of this table changes.
        target = conversion_target(fn, self.device, self.config.dtype)
        super()._apply(fn, recurse)
        if target is not None:
            device, dtype = target
            with self._lock:
                self.engine.to(device, dtype)
                if self.admission is not None:
                    self.admission.to(device)
                self._workspace.to(device)
                if self._pending is not None:
                    self._pending.to(device, dtype)
                self.last_failed_keys = self.last_failed_keys.to(device)
                self.last_evicted_keys = self.last_evicted_keys.to(device)
        return self

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        state.setdefault("_pending", None)
        state.setdefault("update_mode", UpdateMode.FUSED)
        self.__dict__.update(state)
        self._lock = threading.RLock()
        # A copy (deepcopy, pickle) registers with its optimizer (a copy's forgets the original's
        # tables; a shared one ignores a second registration).
        if self._pending is not None:
            self.optimizer.register_deferred(self, self._pending.param)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, value in self.table_state().items():
            destination[prefix + name] = value

    def table_state(self) -> dict[str, torch.Tensor]:
        """The whole table as plain tensors (the entries of ``state_dict()``, without prefix)."""
        with self._lock:
            index = self.index.state_dict()
            data = self.store.gather(index["rows"])
            D = self.embedding_dim
            state = {
                "keys": index["keys"].clone(),
                "embeddings": data[:, :D].clone(),
                "optimizer_state": data[:, D:].clone(),
                "scores": index["scores"].clone(),
                "step": torch.tensor(self.step, dtype=torch.int64),
                "optimizer_step": torch.tensor(self.engine.optimizer_step, dtype=torch.int64),
                "last_timestamp": torch.tensor(self._last_timestamp, dtype=torch.int64),
                "counters": torch.tensor([self._erased, self.engine.nonfinite_grads], dtype=torch.int64),
                "generator_state": self.engine.initializer.generator.get_state(),
            }
            for name in _INDEX_ENTRIES:
                state["index." + name] = index[name].clone()
            if self.admission is not None:
                for name, value in self.admission.state_dict().items():
                    state["admission." + name] = value.clone()
        return state

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        expected = list(_TABLE_ENTRIES) + ["index." + n for n in _INDEX_ENTRIES]
        if self.admission is not None:
            expected += ["admission." + n for n in _ADMISSION_ENTRIES]
        load_own_entries(self, expected, self.load_table_state, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)

    def load_table_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the table from :meth:`table_state` entries; validates everything first and
        raises ValueError (naming the entry) without changing the table on any problem. A
        deferred table's pending gradient (computed against the old rows) is dropped."""
        from dynemb.nn.state import load_table_state

        with self._lock:
            load_table_state(self, state)
            if self._pending is not None:
                self._pending.clear()
