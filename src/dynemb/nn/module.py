"""The engine shared by DynamicEmbedding and DynamicEmbeddingBag: index + rows + optimizer.

N ids in a batch, U unique ids, D embedding dim, S optimizer state columns.

Forward: de-duplicate ids -> find_or_insert (training) or find (eval) -> gather rows [U, D+S]
-> embeddings [U, D], which torch's own embedding / embedding_bag expand and pool. Backward:
torch reduces the output gradient to one [U, D] gradient per unique key; the fused optimizer
then updates those rows and writes them back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from dynemb.config import TableConfig
from dynemb.nn.admission import FrequencyAdmission
from dynemb.optim.base import RowOptimizer
from dynemb.storage.device_store import DeviceRowStore
from dynemb.storage.initializers import RowInitializer
from dynemb.table.base import InsertResult
from dynemb.table.index import KeyIndex, check_keys, rounded_capacity
from dynemb.workspace import Workspace
from dynemb.types import ScoreStrategy


class _Batch:
    """What backward needs from one forward: unique keys [U], their rows [U] (-1 if not in the
    table), in-table flags [U], the gathered rows [U, D+S] and the table version then."""

    __slots__ = ("keys", "rows", "ok", "data", "version")

    def __init__(self, keys, rows, ok, data, version):
        self.keys, self.rows, self.ok, self.data, self.version = keys, rows, ok, data, version


class _FusedUpdate(torch.autograd.Function):
    """Identity on the batch's embeddings whose backward applies the table's optimizer."""

    @staticmethod
    def forward(ctx, trigger, table, batch):
        ctx.table, ctx.batch = table, batch
        return batch.data[:, : table.embedding_dim]

    @staticmethod
    def backward(ctx, grad):
        ctx.table._apply_gradients(ctx.batch, grad)
        ctx.table = ctx.batch = None
        return None, None, None


class _FusedSequence(torch.autograd.Function):
    """Sequence lookup ([U, D] rows expanded to [*, D]) whose backward sums the gradient per key
    and applies the table's optimizer."""

    @staticmethod
    def forward(ctx, trigger, table, batch, inverse):
        ctx.table, ctx.batch, ctx.inverse = table, batch, inverse
        D = table.embedding_dim
        return batch.data[:, :D].index_select(0, inverse.reshape(-1)).view(*inverse.shape, D)

    @staticmethod
    def backward(ctx, grad):
        table, batch = ctx.table, ctx.batch
        D = table.embedding_dim
        grad_u = table._sum_per_key(ctx.inverse.reshape(-1), grad.reshape(-1, D), batch.keys.numel())
        table._apply_gradients(batch, grad_u)
        ctx.table = ctx.batch = ctx.inverse = None
        return None, None, None, None


class DynamicTable(torch.nn.Module):
    """A dynamic embedding table: int64 keys -> rows of embedding and optimizer state.

    Args:
        config: the table's :class:`dynemb.TableConfig`.
        optimizer: fused optimizer applied in backward; ``None`` makes the table frozen (its
            outputs do not require grad).

    Training-mode lookups insert missing keys (subject to admission); eval-mode lookups never
    insert and give ``eval_default`` for missing keys. Keys that are not in the table in training
    (not admitted, or failed) get their initial value and are not trained.
    """

    def __init__(self, config: TableConfig, optimizer: RowOptimizer | None = None):
        super().__init__()
        if optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise TypeError(f"optimizer={optimizer!r}: must be a dynemb.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam) or None")
        self.config = config
        self.optimizer = optimizer
        self.embedding_dim = D = config.embedding_dim
        self.state_dim = optimizer.state_dim(D) if optimizer is not None else 0
        capacity = rounded_capacity(config.capacity, config.init_capacity, config.bucket_capacity)
        self.store = DeviceRowStore(
            D + self.state_dim,
            capacity,
            dtype=config.dtype,
            device=config.device,
            init_rows=config.init_capacity,
        )
        self.index = KeyIndex(
            capacity=config.capacity,
            allocator=self.store,
            init_capacity=config.init_capacity,
            bucket_capacity=config.bucket_capacity,
            max_load_factor=config.max_load_factor,
            score_strategy=config.score_strategy,
            check_mode=config.check_mode,
            device=config.device,
        )
        self.initializer = RowInitializer(config.initializer, D, config.seed, config.dtype, config.device)
        self.admission = FrequencyAdmission(config.admission, config.device) if config.admission else None
        self.step = 0
        self.optimizer_step = 0
        self.custom_score: int | None = None
        # Bumped by every write to rows or index; backward re-finds keys when it changed.
        self._version = 0
        self._workspace = Workspace(config.device)

    @property
    def device(self) -> torch.device:
        return self.config.device

    @property
    def last_failed_keys(self) -> torch.Tensor:
        """Tensor[int64]: keys that failed to insert in the last inserting call."""
        return self.index.last_failed_keys

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"embedding_dim={c.embedding_dim}, capacity={self.index.capacity()}, "
            f"score_strategy='{c.score_strategy}', optimizer={self.optimizer!r}, device='{c.device}'"
        )

    def set_score(self, score: int) -> None:
        """Score given to keys used from now on (``customized`` strategy only)."""
        if self.index.strategy is not ScoreStrategy.CUSTOMIZED:
            raise ValueError(f"set_score needs score_strategy='customized', this table uses '{self.index.strategy}'")
        if not isinstance(score, int) or isinstance(score, bool):
            raise ValueError(f"score={score!r}: must be an int")
        self.custom_score = score

    def _check_ids(self, ids: torch.Tensor, name: str = "ids") -> torch.Tensor:
        return check_keys(ids, name, self.device)

    def _given_scores(self, n: int) -> torch.Tensor | None:
        if self.index.strategy is not ScoreStrategy.CUSTOMIZED:
            return None
        if self.custom_score is None:
            raise ValueError("score_strategy='customized': call set_score(score) before training lookups")
        return torch.full((n,), self.custom_score, dtype=torch.int64, device=self.device)

    def _new_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Initial rows [n, D+S] of keys [n]."""
        embeddings = self.initializer(keys)  # [n, D]
        if not self.state_dim:
            return embeddings
        rows = torch.empty(keys.numel(), self.store.width, dtype=self.config.dtype, device=self.device)
        rows[:, : self.embedding_dim] = embeddings
        self.optimizer.init_state(rows[:, self.embedding_dim :])
        return rows

    def _upsert(self, keys: torch.Tensor, counts: torch.Tensor, given: torch.Tensor | None, report: bool = True) -> InsertResult:
        """find_or_insert of unique sorted keys; new rows are initialised before failures are
        reported (``report=False``: the caller reports once it has written its own values)."""
        result = self.index.upsert_unique(keys, counts, given)
        inserted = result.inserted
        if bool(inserted.any()):
            new = inserted.nonzero().squeeze(1)
            self.store.scatter(result.rows.index_select(0, new), self._new_rows(keys.index_select(0, new)))
        self._version += 1
        if report:
            self.index.report_failures(result.failed_keys, keys.numel())
        return result

    def _resolve_train(self, keys: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [U] (-1 where not in the table) and in-table flags [U] of unique keys, inserting."""
        self.index.step = self.step
        given = self._given_scores(keys.numel())
        if self.admission is None:
            r = self._upsert(keys, counts, given)
            return r.rows, r.ok
        _, candidate = self.index.find(keys)
        missing = (~candidate).nonzero().squeeze(1)
        if missing.numel():
            candidate[missing] = self.admission.admit(keys[missing], counts[missing], self.step)
        sel = candidate.nonzero().squeeze(1)
        r = self._upsert(keys[sel], counts[sel], None if given is None else given[sel], report=False)
        self.admission.forget(keys[sel][r.inserted])
        self.index.report_failures(r.failed_keys, sel.numel())
        rows = torch.full_like(keys, -1).index_copy_(0, sel, r.rows)
        ok = torch.zeros_like(candidate).index_copy_(0, sel, r.ok)
        return rows, ok

    def _gather_batch(self, ids: torch.Tensor) -> tuple[_Batch, torch.Tensor]:
        """De-duplicate ids, resolve them (inserting in training) and gather their rows.

        Returns the batch (unique keys [U], rows [U], in-table flags [U], rows data [U, D+S]) and
        the inverse ([*], ids' shape) of each id into the unique keys.
        """
        flat = self._check_ids(ids)
        keys, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        D = self.embedding_dim
        if self.training:
            self.step += 1
            rows, ok = self._resolve_train(keys, counts)
        else:
            rows, ok = self.index.find(keys)
        data = self.store.gather(rows.clamp(min=0))  # [U, D+S]
        missing = (~ok).nonzero().squeeze(1)
        if missing.numel():
            if self.training:
                fill = self.initializer(keys.index_select(0, missing))
            else:
                fill = torch.full((missing.numel(), D), self.config.eval_default, dtype=data.dtype, device=self.device)
            data[:, :D].index_copy_(0, missing, fill)
        return _Batch(keys, rows, ok, data, self._version), inverse.view(ids.shape)

    def _trains(self) -> bool:
        return self.training and self.optimizer is not None and torch.is_grad_enabled()

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of the unique ids and how to expand them.

        Args:
            ids (Tensor[int64]): [*] any shape.
        Returns:
            embeddings (Tensor): [U, D], requiring grad when training with an optimizer.
            inverse (Tensor[int64]): [*] (ids' shape) index of each id into ``embeddings``.
        """
        batch, inverse = self._gather_batch(ids)
        if self._trains():
            trigger = torch.empty(0, device=self.device, requires_grad=True)
            return _FusedUpdate.apply(trigger, self, batch), inverse
        return batch.data[:, : self.embedding_dim], inverse

    def lookup_sequence(self, ids: torch.Tensor) -> torch.Tensor:
        """One embedding per id: ids [*] -> [*, D]; in training, backward updates the rows."""
        batch, inverse = self._gather_batch(ids)
        if self._trains():
            trigger = torch.empty(0, device=self.device, requires_grad=True)
            return _FusedSequence.apply(trigger, self, batch, inverse)
        return F.embedding(inverse, batch.data[:, : self.embedding_dim])

    def _sum_per_key(self, inverse: torch.Tensor, grad: torch.Tensor, num_keys: int) -> torch.Tensor:
        """Gradient summed per unique key: inverse [N], grad [N, D] -> [U, D].

        Sums into a buffer kept between steps (a fresh [U, D] tensor page-faults on CPU); the
        result is consumed by the fused update before the next backward can reuse it.
        """
        buf = self._workspace.get("grad", num_keys, (self.embedding_dim,), grad.dtype)
        return buf.zero_().index_add_(0, inverse, grad)

    def _apply_gradients(self, batch: _Batch, grad: torch.Tensor) -> None:
        """One optimizer step on the batch's in-table rows with grad [U, D] summed per key."""
        self.optimizer_step += 1
        keys, rows, data = batch.keys, batch.rows, batch.data
        if not bool(batch.ok.all()):
            sel = batch.ok.nonzero().squeeze(1)
            keys, rows, data, grad = keys[sel], rows[sel], data[sel], grad[sel]
        if self._version != batch.version:
            # Rows were written since forward (another lookup, insert or update): re-read them,
            # and skip keys evicted or erased meanwhile.
            rows, found = self.index.find(keys)
            sel = found.nonzero().squeeze(1)
            rows, grad = rows[sel], grad[sel]
            data = self.store.gather(rows)
        D = self.embedding_dim
        self.optimizer.update(data[:, :D], data[:, D:], grad, self.optimizer_step)
        self.store.scatter(rows, data)
        self._version += 1

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of keys without side effects.

        Args:
            keys (Tensor[int64]): [*] any shape.
        Returns:
            values (Tensor): [*, D], ``eval_default`` where missing.
            found (Tensor[bool]): [*]
        """
        flat = self._check_ids(keys, "keys")
        rows, found = self.index.find(flat)
        values = self.store.gather(rows.clamp(min=0))[:, : self.embedding_dim]
        values[~found] = self.config.eval_default
        return values.view(*keys.shape, self.embedding_dim), found.view(keys.shape)

    def insert(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Assign rows to keys, inserting missing ones (warm start).

        Args:
            keys (Tensor[int64]): [N] distinct keys.
            values (Tensor): [N, D] embeddings (optimizer state kept for existing keys, initial
                for new ones) or [N, D+S] whole rows including optimizer state.
            scores (Tensor[int64] | None): [N] scores to assign; default: the strategy's.
        Returns:
            Tensor[bool]: [N] the key is in the table now (see check_mode for failures).
        """
        flat = self._check_ids(keys, "keys")
        width = (self.embedding_dim, self.store.width)
        if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.shape[0] != flat.numel() or values.shape[1] not in width:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"values.shape={shape}: must be [{flat.numel()}, {width[0]}] or [{flat.numel()}, {width[1]}]")
        unique, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        if unique.numel() != flat.numel():
            raise ValueError(f"keys has {flat.numel() - unique.numel()} duplicate(s): insert assigns one value per key")
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(flat.numel(), device=self.device)
        given = None
        if scores is not None:
            s = self._check_ids(scores, "scores")
            if s.numel() != flat.numel():
                raise ValueError(f"scores has {s.numel()} values for {flat.numel()} keys")
            given = s.index_select(0, order)
        elif self.index.strategy is ScoreStrategy.CUSTOMIZED:
            given = self._given_scores(unique.numel())
        values = values.detach().to(device=self.device, dtype=self.config.dtype).index_select(0, order)
        self.index.step = self.step
        result = self._upsert(unique, counts, given, report=False)
        ok = result.ok.nonzero().squeeze(1)
        self.store.scatter(result.rows.index_select(0, ok), values.index_select(0, ok))
        # Keys that did fit hold the caller's values before a failure is raised.
        self.index.report_failures(result.failed_keys, unique.numel())
        return result.ok.index_select(0, inverse)

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove keys ([*] int64) and free their rows; returns found ([*] bool)."""
        self._check_ids(keys, "keys")
        self._version += 1
        return self.index.erase(keys)

    def export(self, chunk_size: int = 1 << 16) -> Iterator[dict[str, torch.Tensor]]:
        """Yield every key with its row, in chunks: dicts of ``keys`` [K] int64, ``embeddings``
        [K, D], ``optimizer_state`` [K, S], ``scores`` [K] int64."""
        D = self.embedding_dim
        for keys, rows, scores in self.index.export(chunk_size):
            data = self.store.gather(rows)
            yield {"keys": keys, "embeddings": data[:, :D], "optimizer_state": data[:, D:], "scores": scores}

    def size(self) -> int:
        """Keys held."""
        return self.index.size()

    def capacity(self) -> int:
        """Most keys held (the configured capacity rounded up to whole buckets)."""
        return self.index.capacity()

    def load_factor(self) -> float:
        """size / currently allocated capacity."""
        return self.index.load_factor()

    def stats(self) -> dict[str, int | float]:
        """size, capacity, current_capacity, load_factor, inserts, evictions, failed_inserts,
        admission_rejections, growths, step."""
        s = self.index.stats()
        s["admission_rejections"] = self.admission.rejections if self.admission else 0
        s["step"] = self.step
        return s
