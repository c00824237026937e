"""W1-evict contender: TorchRec's managed-collision module (MCH, LFU, eviction every step).

N ids per step, D embedding dim, C capacity (the dynemb table's real capacity, ``stats()``).

Issue 19 asks W1-evict dynemb >= 2x TorchRec's ``ManagedCollisionEmbeddingCollection`` with an
LFU ``MCHManagedCollisionModule``, eviction every step, at the same capacity. What the contender
is (torchrec 1.8, unsharded, CPU, fp32):

* module: ``ManagedCollisionEmbeddingCollection(EmbeddingCollection([cfg]),
  ManagedCollisionCollection({"t": MCHManagedCollisionModule(zch_size=C,
  eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)}, [cfg]))`` with
  ``cfg = EmbeddingConfig(name="t", embedding_dim=D, num_embeddings=C, feature_names=["f"])``.
* input: a ``KeyedJaggedTensor`` of one feature, the step's N raw int64 keys as values, lengths
  all 1 (N samples of one id each), built in the step; the loss takes the EC's output values [N, D].
* keys: no ``input_hash_func``, so the raw keys are kept: the module holds the resident keys in a
  sorted int64 buffer and remaps by ``searchsorted``; ``input_hash_size`` (default 2**63 - 1) is
  only what ``input_size()`` reports for sharding. Every int64 key works except INT64_MAX, the
  empty-slot sentinel (:func:`check_keys` refuses a stream holding it).
* each training forward: the MCH module takes the batch's ``torch.unique`` counts; LFU adds them to
  the resident keys' counts, and the new keys compete with their count in this batch against the
  residents' cumulative counts (a stable descending ``argsort`` over C + new keys; ties keep the
  resident); winners take the losers' rows, then its C-entry buffers are re-sorted and the batch is
  remapped. Keys that are not resident map to row C - 1, one row shared by every miss (so it holds
  C - 1 keys). On a full table the LFU admits only keys seen more than the weakest resident.
* evicted rows: in torchrec 1.8 the unsharded MC-EC's ``evict()`` is a no-op (a TODO), so a new key
  would inherit the evicted key's trained row and optimizer state. TorchRec's sharded MC-EC resets
  them (``reset_embedding_weight_momentum`` and the table's ``init_fn``); the contender does the
  same: a forward hook on the ``ManagedCollisionCollection`` takes ``evict()``'s row ids and, before
  the EC lookup, draws those rows again from N(0, 1) (``nn.Embedding``'s init, the EC's) and zeroes
  their row-wise Adagrad state, as dynemb initialises a new key's row and state.
* training: the EC builds a dense-gradient ``nn.Embedding``; the contender sets ``sparse=True`` on it
  (a dense gradient would add and zero C x D floats every step) and runs the reference contender's
  update on the sparse gradient: ``torch.optim.SGD``, or FBGEMM's row-wise Adagrad in plain torch
  (``w1_train_step.rowwise_adagrad_step``).

The hook also counts per step the rows evicted and the ids mapped to the shared miss row (one
comparison over the N remapped ids, no host sync). A parity check (:func:`parity_error`) runs the
contender and the reference from zero rows with room for every key: the same rows must come out.
"""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from keygen import zipf_keys
from w1_train_step import DIM, EPS, EXPONENT, LR, Reference, key_counts, rowwise_adagrad_step

TABLE, FEATURE = "t", "f"
# MCH's empty-slot sentinel: a key equal to it would match every empty slot.
INT64_MAX = torch.iinfo(torch.int64).max


def contender_name(case: str) -> str:
    return "torchrec MCH(LFU, eviction_interval=1)+" + ("torch.optim.SGD" if case == "sgd" else "rowwise_adagrad(plain torch)")


def check_keys(batches: torch.Tensor) -> None:
    if bool((batches == INT64_MAX).any()):
        raise ValueError(f"batches: hold the key {INT64_MAX}, MCH's empty-slot sentinel; the MCH contender cannot train on it")


class Mch:
    """The MC-EC above on raw int64 keys with the case's optimizer (see the module doc).
    ``zero_rows``: start every row, and draw evicted ones, as zeros (the parity check)."""

    def __init__(self, case: str, v: torch.Tensor, capacity: int, ids_per_step: int, *, zero_rows: bool = False):
        if capacity < 2:
            raise ValueError(f"capacity={capacity}: MCH needs >= 2 rows (the last one is the shared miss row)")
        self.case, self.v, self.capacity, self.zero_rows = case, v, capacity, zero_rows
        cfg = EmbeddingConfig(
            name=TABLE,
            embedding_dim=DIM,
            num_embeddings=capacity,
            feature_names=[FEATURE],
            init_fn=torch.nn.init.zeros_ if zero_rows else None,
        )
        self.mch = MCHManagedCollisionModule(zch_size=capacity, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
        self.mcc = ManagedCollisionCollection({TABLE: self.mch}, [cfg])
        ec = EmbeddingCollection([cfg])
        self.module = ManagedCollisionEmbeddingCollection(ec, self.mcc)
        self.emb = ec.embeddings[TABLE]
        self.emb.sparse = True
        if case == "sgd":
            self.opt = torch.optim.SGD(self.emb.parameters(), lr=LR)
        else:
            self.state = torch.zeros(capacity, 1)
        self.lengths = torch.ones(ids_per_step, dtype=torch.int64)  # [N] one id per sample
        self.evicted = 0  # rows evicted (empty slots filled included) since construction
        self.missed = torch.zeros((), dtype=torch.int64)  # ids mapped to the shared miss row
        self.mcc.register_forward_hook(self._reset_evicted)

    def _reset_evicted(self, mcc: ManagedCollisionCollection, inputs, remapped: KeyedJaggedTensor) -> None:
        rows = mcc.evict()[TABLE]  # [E] row ids whose keys the MCH module replaced, or None
        if rows is not None:
            self.evicted += rows.numel()
            fresh = torch.zeros(rows.numel(), DIM) if self.zero_rows else torch.randn(rows.numel(), DIM)
            with torch.no_grad():
                self.emb.weight.index_copy_(0, rows, fresh)
            if self.case != "sgd":
                self.state.index_fill_(0, rows, 0.0)
        self.missed += (remapped.values() == self.capacity - 1).sum()

    def step(self, keys: torch.Tensor) -> None:
        kjt = KeyedJaggedTensor(keys=[FEATURE], values=keys, lengths=self.lengths[: keys.numel()])
        out, _ = self.module(kjt)
        (out[FEATURE].values() * self.v).sum().backward()
        if self.case == "sgd":
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            rowwise_adagrad_step(self.emb.weight, self.state, LR, EPS)

    def rows_of(self, keys: torch.Tensor) -> torch.Tensor:
        """[K] the rows the module maps keys [K] to (C - 1 for keys it does not hold), untimed."""
        remapped = self.mch.remap({FEATURE: JaggedTensor(values=keys, lengths=torch.ones_like(keys))})
        return remapped[FEATURE].values()

    def counters(self) -> dict[str, int]:
        return {"evictions": self.evicted, "missed_ids": int(self.missed), "open_slots": int(self.mch.open_slots())}


def parity_error(case: str, seed: int = 0) -> float:
    """Max |MCH - reference| over the rows after 4 small steps from zero rows, with room for every
    key (C = K + 1: nothing evicted, no miss); inf if a key is not resident. As for dynemb, not zero:
    the per-key gradient sums run in different orders."""
    gen = torch.Generator().manual_seed(seed)
    batches = torch.stack([zipf_keys(4096, 10**6, EXPONENT, gen) for _ in range(4)])
    dense, _, _, K = key_counts(batches)
    v = torch.randn(DIM, generator=gen)
    reference = Reference(case, K, v)
    with torch.no_grad():
        reference.emb.weight.zero_()
    mch = Mch(case, v, K + 1, batches.shape[1], zero_rows=True)
    for batch, ids in zip(batches, dense):
        mch.step(batch)
        reference.step(ids)
    rows = mch.rows_of(torch.unique(batches))  # [K] in the reference's id order
    if bool((rows == K).any()):
        return float("inf")
    return (mch.emb.weight.detach()[rows] - reference.emb.weight.detach()).abs().max().item()
