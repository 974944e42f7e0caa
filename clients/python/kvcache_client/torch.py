"""kvcache_client.torch: the worker side of kvcached in torch.

What a model worker needs around the client (docs/PYTHON.md, "The torch worker side"):

* **score capture**: :func:`attention_row` turns one decode step of one layer (the new
  token's query and the layer's keys) into the row kvcached takes (SPEC.md "Terms": the
  softmax attention of the newest token over the cache plus itself, mean-pooled over the
  query heads, every GQA query head counting once), or, for a tensor-parallel rank, its
  heads' sum and count; batched over sequences of different lengths; with the paper's
  order-preserving scorer variants (``"vnorm"``, ``"entropy"``). :class:`StepScores`
  gathers a step's layers and gives the report: ``[layers, tokens]``, or the one folded
  row of a folded sequence (SPEC.md "Folded reports").
* **KV caches** that apply the daemon's decisions: :class:`DenseKvCache` (per-layer
  tensors the worker owns) and :class:`PooledKvCache` (the daemon's host shared-memory KV
  pool, mapped by :class:`KvPoolMapping`, addressed through the daemon's slot table).
* **a decode loop** (:class:`DecodeLoop`) that follows ``next_needs_scores``: no capture
  on the steps that need no scores.

The rest of ``kvcache_client`` does not import this module, so the package works without
torch. Importing this module without torch raises ImportError.

Shapes (``d`` the head dimension; GQA: query head ``h`` reads KV head ``h // (heads //
kv_heads)``, the grouping of Llama's ``repeat_kv``):

    q       [heads, d]             or [batch, heads, d]            the new token's queries
    keys    [kv_heads, n, d]       or [batch, kv_heads, n, d]      the cache AND the new
    values  like keys                                              token's key (last valid)

``n`` counts the cached tokens plus the new one (``tokens`` of the TrackedSequence). A
batch pads shorter sequences at the end and says their ``lengths``. Rows come back as
float32 on the inputs' device, the softmax taken in float32 (float64 inputs: float64).

Not thread-safe: captures, caches and loops belong to one worker thread.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

try:
    import torch
except ImportError as _error:  # pragma: no cover - exercised where torch is absent
    raise ImportError("kvcache_client.torch needs torch (Debian: python3-torch; or pip "
                      "install torch); the rest of kvcache_client works without it") \
        from _error

from .fold import FoldWeights

__all__ = ["SCORERS", "DecodeLoop", "DenseKvCache", "KvPoolMapping", "PooledKvCache",
           "StepScores", "attention_row", "attention_weights", "pool_weights"]

#: Scorers: plain attention; VNorm (each token's attention times the mean-normalized L2
#: norm of its value vector, per KV head, before pooling); entropy (the pooled row times
#: its normalized entropy H / log n, a per-layer scalar that keeps the row's order).
SCORERS = ("attention", "vnorm", "entropy")

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}

Tensor = torch.Tensor


# -- score capture -------------------------------------------------------------------------

def attention_weights(q: Tensor, keys: Tensor, *, lengths: Optional[Any] = None,
                      scale: Optional[float] = None) -> Tensor:
    """Softmax attention of the new token's query heads over ``keys``.

    Args:
      q: ``[heads, d]`` or ``[batch, heads, d]``.
      keys: ``[kv_heads, n, d]`` or ``[batch, kv_heads, n, d]``; ``heads`` a multiple of
        ``kv_heads`` (GQA).
      lengths: batched only: the valid keys of each sequence (the rest is padding and gets
        weight 0). Default: all ``n``.
      scale: the logit scale, default ``1 / sqrt(d)``.
    Returns:
      ``[heads, n]`` or ``[batch, heads, n]`` (float32; float64 for float64 inputs); each
      head's row sums to 1 over the valid keys.
    Raises:
      ValueError: shapes that do not fit.
    """
    batched = q.dim() == 3
    qb, kb = (q, keys) if batched else (q.unsqueeze(0), keys.unsqueeze(0))
    if qb.dim() != 3 or kb.dim() != 4:
        raise ValueError(f"q must be [heads, d] or [batch, heads, d] and keys [kv_heads, n, "
                         f"d] or [batch, kv_heads, n, d]; got {tuple(q.shape)} and "
                         f"{tuple(keys.shape)}")
    batch, heads, d = qb.shape
    _, kv_heads, n, kd = kb.shape
    if kb.shape[0] != batch or kd != d:
        raise ValueError(f"q {tuple(q.shape)} and keys {tuple(keys.shape)} disagree on the "
                         "batch or the head dimension")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = heads // kv_heads
    qg = qb.to(wide).reshape(batch, kv_heads, group, d)
    logits = torch.matmul(qg, kb.to(wide).transpose(-1, -2))  # [batch, kv, group, n]
    logits = logits * (scale if scale is not None else 1.0 / math.sqrt(d))
    valid = _valid_mask(lengths, batch, n, keys.device) if batched else None
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = torch.softmax(logits, dim=-1).reshape(batch, heads, n)
    return weights if batched else weights[0]


def pool_weights(weights: Tensor, *, values: Optional[Tensor] = None,
                 scorer: str = "attention", lengths: Optional[Any] = None,
                 head_sum: bool = False) -> Union[Tensor, Tuple[Tensor, int]]:
    """Pools attention weights ``[heads, n]`` (or ``[batch, heads, n]``) into the row.

    For a model that has the weights already (eager attention, ``output_attentions``).
    ``values`` (``[kv_heads, n, d]``, batched ``[batch, kv_heads, n, d]``) are needed by
    ``scorer="vnorm"``. ``head_sum``: return ``(sum over these heads, head count)`` for a
    tensor-parallel rank instead of the mean. See :func:`attention_row`.
    """
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; use one of {SCORERS}")
    batched = weights.dim() == 3
    w = weights if batched else weights.unsqueeze(0)
    batch, heads, n = w.shape
    if not w.dtype.is_floating_point:
        raise ValueError(f"attention weights must be floats, not {w.dtype}")
    if w.dtype != torch.float64:
        w = w.float()
    valid = _valid_mask(lengths, batch, n, w.device) if batched else None
    if valid is not None:
        w = w.masked_fill(~valid[:, None, :], 0.0)
    if scorer == "vnorm":
        if values is None:
            raise ValueError("scorer='vnorm' needs the layer's values")
        vb = values if batched else values.unsqueeze(0)
        if vb.dim() != 4 or vb.shape[0] != batch or vb.shape[2] != n:
            raise ValueError(f"values {tuple(values.shape)} do not fit attention weights "
                             f"{tuple(weights.shape)}")
        kv_heads = vb.shape[1]
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
        norms = torch.linalg.vector_norm(vb.to(w.dtype), dim=-1)  # [batch, kv, n]
        if valid is not None:
            norms = norms.masked_fill(~valid[:, None, :], 0.0)
        counts = _valid_counts(lengths, batch, n, w.device, w.dtype)
        mean = norms.sum(-1, keepdim=True) / counts[:, None, None]
        factor = torch.where(mean > 0, norms / mean, torch.ones_like(norms))
        w = (w.reshape(batch, kv_heads, heads // kv_heads, n) * factor[:, :, None, :]) \
            .reshape(batch, heads, n)
    if head_sum:
        if scorer == "entropy":
            raise ValueError("scorer='entropy' weighs the pooled row of ALL heads; a "
                             "tensor-parallel rank's head sum cannot: gather the heads "
                             "first, or use 'attention' or 'vnorm'")
        row = w.sum(1)
        return (row if batched else row[0]), heads
    row = w.sum(1) / heads
    if scorer == "entropy":
        counts = _valid_counts(lengths, batch, n, w.device, w.dtype)
        total = row.sum(-1, keepdim=True).clamp_min(torch.finfo(row.dtype).tiny)
        p = row / total
        entropy = -(p * torch.log(p.clamp_min(torch.finfo(row.dtype).tiny))).sum(-1)
        log_n = torch.log(counts)
        factor = torch.where(log_n > 0, entropy / log_n.clamp_min(1e-30),
                             torch.ones_like(entropy))
        row = row * factor[:, None]
    return row if batched else row[0]


def attention_row(q: Tensor, keys: Tensor, *, values: Optional[Tensor] = None,
                  scorer: str = "attention", lengths: Optional[Any] = None,
                  head_sum: bool = False,
                  scale: Optional[float] = None) -> Union[Tensor, Tuple[Tensor, int]]:
    """One layer's scores of one decode step (SPEC.md "Terms", "Tensor-parallel ranks").

    Args:
      q: the new token's queries, ``[heads, d]`` or ``[batch, heads, d]``.
      keys: the layer's keys, the new token's included as the last valid one:
        ``[kv_heads, n, d]`` or ``[batch, kv_heads, n, d]``.
      values: like ``keys``; needed by ``scorer="vnorm"``.
      scorer: ``"attention"``, ``"vnorm"`` or ``"entropy"`` (see :data:`SCORERS`).
      lengths: batched only: valid keys per sequence (a list or a 1-D tensor).
      head_sum: for a tensor-parallel rank: return ``(sum of these heads' rows, heads)``
        (the daemon joins ``sum_p sums / sum_p heads``); not with ``"entropy"``.
      scale: logit scale, default ``1 / sqrt(d)`` (the model's own, if it differs).
    Returns:
      ``[n]`` or ``[batch, n]`` float32 (zeros past each length), or with ``head_sum`` the
      pair ``(sum, heads)``. Plain attention rows sum to 1 over the valid keys.
    Raises:
      ValueError: shapes that do not fit, an unknown scorer, vnorm without values.
    """
    weights = attention_weights(q, keys, lengths=lengths, scale=scale)
    return pool_weights(weights, values=values, scorer=scorer, lengths=lengths,
                        head_sum=head_sum)


def _valid_mask(lengths: Optional[Any], batch: int, n: int,
                device: torch.device) -> Optional[Tensor]:
    if lengths is None:
        return None
    lens = torch.as_tensor(lengths, device=device).reshape(-1)
    if lens.numel() != batch:
        raise ValueError(f"{lens.numel()} lengths for a batch of {batch}")
    if bool((lens < 1).any()) or bool((lens > n).any()):
        raise ValueError(f"lengths must be in 1..{n}, got {lens.tolist()}")
    return torch.arange(n, device=device)[None, :] < lens[:, None]


def _valid_counts(lengths: Optional[Any], batch: int, n: int, device: torch.device,
                  dtype: torch.dtype) -> Tensor:
    if lengths is None:
        return torch.full((batch,), float(n), device=device, dtype=dtype)
    return torch.as_tensor(lengths, device=device).reshape(-1).to(dtype)


class StepScores:
    """The scores of one decode step, gathered layer by layer as the model runs.

    ``add(q, keys, values)`` once per layer, in the order the model runs them (or
    ``add_weights(weights)`` where the model has its attention weights); then
    :meth:`report` is what ``SequenceBatch.step`` takes for the sequence: ``[layers,
    tokens]`` float32, or, when ``fold_weights`` are given (a folded sequence), the one
    folded row ``sum_l w_l * row_l`` accumulated in float64 as the layers come in (the
    per-layer rows are then never kept). A batch (``q [batch, heads, d]``) gives one report
    per sequence: ``report(i)``, trimmed to its length.

    ``head_sum=True`` (a tensor-parallel rank): rows are the rank's heads' sums, and the
    batch that sends them carries the head count (``client.batch(head_count=...)``).
    ``seconds`` is the host time spent in this object (capture cost; on CUDA it does not
    wait for the device).
    """

    def __init__(self, *, scorer: str = "attention",
                 fold_weights: Optional[Union[FoldWeights, Sequence[float]]] = None,
                 head_sum: bool = False, scale: Optional[float] = None) -> None:
        if scorer not in SCORERS:
            raise ValueError(f"unknown scorer {scorer!r}; use one of {SCORERS}")
        if head_sum and scorer == "entropy":
            raise ValueError("scorer='entropy' cannot be taken from one rank's head sum")
        self.scorer = scorer
        self.head_sum = head_sum
        self.scale = scale
        self._weights: Optional[Tuple[float, ...]] = None
        if fold_weights is not None:
            self._weights = tuple(float(w) for w in (
                fold_weights.layer_weights if isinstance(fold_weights, FoldWeights)
                else fold_weights))
        self._rows: List[Tensor] = []
        self._folded: Optional[Tensor] = None
        self._lengths: Optional[List[int]] = None
        self._batched: Optional[bool] = None
        self.layers = 0
        self.heads = 0
        self.seconds = 0.0

    @property
    def folded(self) -> bool:
        return self._weights is not None

    def add(self, q: Tensor, keys: Tensor, values: Optional[Tensor] = None, *,
            lengths: Optional[Any] = None) -> None:
        """Adds the next layer from its queries and keys (see :func:`attention_row`)."""
        start = time.perf_counter()
        weights = attention_weights(q, keys, lengths=lengths, scale=self.scale)
        self._add_weights(weights, values, lengths)
        self.seconds += time.perf_counter() - start

    def add_weights(self, weights: Tensor, values: Optional[Tensor] = None, *,
                    lengths: Optional[Any] = None) -> None:
        """Adds the next layer from attention weights ``[heads, n]`` (batched ``[batch,
        heads, n]``) the model computed anyway (see :func:`pool_weights`)."""
        start = time.perf_counter()
        self._add_weights(weights, values, lengths)
        self.seconds += time.perf_counter() - start

    def _add_weights(self, weights: Tensor, values: Optional[Tensor],
                     lengths: Optional[Any]) -> None:
        batched = weights.dim() == 3
        if self._batched is None:
            self._batched = batched
            if lengths is not None:
                self._lengths = [int(x) for x in torch.as_tensor(lengths).reshape(-1)]
        elif self._batched != batched:
            raise ValueError("every layer of a step must be batched alike")
        pooled = pool_weights(weights, values=values, scorer=self.scorer, lengths=lengths,
                              head_sum=self.head_sum)
        if self.head_sum:
            row, heads = pooled  # type: ignore[misc]
            if self.layers and heads != self.heads:
                raise ValueError(f"layer {self.layers} has {heads} heads, layer 0 "
                                 f"{self.heads}")
            self.heads = heads
        else:
            row = pooled
            self.heads = weights.shape[-2]
        if self._weights is not None:
            if self.layers >= len(self._weights):
                raise ValueError(f"the fold weights cover {len(self._weights)} layers; "
                                 f"this is layer {self.layers}")
            wide = torch.float32 if row.device.type == "mps" else torch.float64
            term = row.to(wide) * self._weights[self.layers]
            self._folded = term if self._folded is None else self._folded + term
        else:
            self._rows.append(row.float())
        self.layers += 1

    def rows(self) -> Tensor:
        """``[layers, n]`` (batched ``[batch, layers, n]``) float32 of a per-layer capture."""
        if self._weights is not None:
            raise ValueError("a folded capture keeps no per-layer rows: use report()")
        if not self._rows:
            raise ValueError("no layer was added")
        return torch.stack(self._rows, dim=-2)

    def folded_row(self) -> Tensor:
        """``[n]`` (batched ``[batch, n]``) float32: the folded row."""
        if self._weights is None:
            raise ValueError("not a folded capture (give fold_weights)")
        if self.layers != len(self._weights):
            raise ValueError(f"{self.layers} layers were added, the fold weights cover "
                             f"{len(self._weights)}")
        return self._folded.to(torch.float32)  # type: ignore[union-attr]

    def report(self, index: Optional[int] = None) -> Tensor:
        """What ``SequenceBatch.step`` takes for one sequence: ``[layers, tokens]``, or
        the folded ``[tokens]``. ``index``: the sequence's row of a batched capture
        (required then), trimmed to its length."""
        start = time.perf_counter()
        data = self.folded_row() if self._weights is not None else self.rows()
        if self._batched:
            if index is None:
                raise ValueError("a batched capture has one report per sequence: "
                                 "report(index)")
            data = data[index]
            if self._lengths is not None:
                data = data[..., :self._lengths[index]]
        elif index not in (None, 0):
            raise ValueError("an unbatched capture has one report")
        self.seconds += time.perf_counter() - start
        return data


# -- KV caches -----------------------------------------------------------------------------

class _StepState:
    """What both caches track between a step's attention and its decision."""

    def __init__(self, layers: int, positions: Sequence[int], next_position: int) -> None:
        self.layers = layers
        self.positions: List[int] = list(positions)
        if any(b <= a for a, b in zip(self.positions, self.positions[1:])):
            raise ValueError("positions must ascend")
        self.next_position = next_position
        self._pending: Dict[int, Tuple[Tensor, Tensor]] = {}

    def _pend(self, layer: int, k: Tensor, v: Tensor) -> None:
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} of {self.layers}")
        if layer in self._pending:
            raise ValueError(f"layer {layer} was extended twice in one step; apply() the "
                             "decision first")
        self._pending[layer] = (k, v)

    def _evicted_indices(self, decision: Any) -> Tuple[List[int], bool]:
        """(indices into positions of the evicted cached tokens, whether the new token
        itself was evicted); checks the decision against this cache."""
        if not getattr(decision, "ok", True):
            raise ValueError(f"decision of step {decision.step} was rejected "
                             f"({decision.message}); nothing changed, do not apply it")
        if len(self._pending) != self.layers:
            raise ValueError(f"{len(self._pending)} of {self.layers} layers were extended "
                             "this step; extend every layer before apply()")
        index = {p: i for i, p in enumerate(self.positions)}
        gone, new_evicted = [], False
        for position in decision.evicted:
            if position == self.next_position:
                new_evicted = True
            elif position in index:
                gone.append(index[position])
            else:
                raise ValueError(f"step {decision.step} evicts position {position}, which "
                                 "this cache does not hold")
        expected = len(self.positions) + 1 - len(decision.evicted)
        size = getattr(decision, "cache_size", expected)
        if size != expected:
            raise ValueError(f"step {decision.step}: the daemon's cache holds {size} "
                             f"tokens, this one would hold {expected}")
        return sorted(gone), new_evicted

    def _commit(self, gone: List[int], new_evicted: bool) -> None:
        if gone:
            drop = set(gone)
            self.positions = [p for i, p in enumerate(self.positions) if i not in drop]
        if not new_evicted:
            self.positions.append(self.next_position)
        self.next_position += 1
        self._pending.clear()


class DenseKvCache(_StepState):
    """One sequence's K and V, per layer ``[kv_heads, n, d]``, that the worker owns.

    A decode step: ``keys, values = cache.extend(layer, k, v)`` per layer (the new token's
    ``k, v`` ``[kv_heads, d]`` appended; attend over what it returns), then
    ``cache.apply(decision)``: the evicted positions leave every layer at once (the new
    token too, when it was evicted in its own step). ``positions`` are the cached
    positions, ascending; ``next_position`` the position of the next step's token.

    Storage is token-major (``[capacity, kv_heads, d]`` per layer, as in a paged pool), so
    what it returns are ``[kv_heads, n, d]`` views with the strides of what
    :class:`PooledKvCache` gathers: the same attention code gives the same bits on both.
    """

    def __init__(self, keys: Sequence[Tensor], values: Sequence[Tensor], *,
                 positions: Optional[Sequence[int]] = None,
                 next_position: Optional[int] = None, capacity: Optional[int] = None) -> None:
        """``keys``/``values``: per layer ``[kv_heads, n, d]`` (the prefill's). Positions
        default to ``0 .. n-1``, ``next_position`` to the last + 1; ``capacity``: tokens
        preallocated (it grows as needed)."""
        if not keys or len(keys) != len(values):
            raise ValueError("give the keys and values of every layer")
        n = keys[0].shape[1]
        shape = tuple(keys[0].shape)
        for layer, (k, v) in enumerate(zip(keys, values)):
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(f"layer {layer}: keys {tuple(k.shape)} and values "
                                 f"{tuple(v.shape)}, layer 0 has {shape}")
        if positions is None:
            positions = range(n)
        if len(positions) != n:
            raise ValueError(f"{len(positions)} positions for {n} cached tokens")
        super().__init__(len(keys), positions,
                         next_position if next_position is not None
                         else (positions[-1] + 1 if n else 0))
        self.kv_heads, self.head_dim = shape[0], shape[2]
        self.dtype, self.device = keys[0].dtype, keys[0].device
        cap = max(capacity or 0, n + 1)
        self._k = [self._buffer(cap) for _ in keys]   # per layer [capacity, kv_heads, d]
        self._v = [self._buffer(cap) for _ in keys]
        for layer in range(self.layers):
            self._k[layer][:n] = keys[layer].transpose(0, 1)
            self._v[layer][:n] = values[layer].transpose(0, 1)

    def _buffer(self, capacity: int) -> Tensor:
        return torch.empty(capacity, self.kv_heads, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def __len__(self) -> int:
        return len(self.positions)

    def keys(self, layer: int) -> Tensor:
        """``[kv_heads, n, d]``: the cached keys of ``layer`` (a view; not the pending one)."""
        return self._k[layer][:len(self.positions)].transpose(0, 1)

    def values(self, layer: int) -> Tensor:
        return self._v[layer][:len(self.positions)].transpose(0, 1)

    def extend(self, layer: int, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Appends the step's token to ``layer``; returns its keys and values
        ``[kv_heads, n + 1, d]`` (views, valid until ``apply``)."""
        n = len(self.positions)
        if self._k[layer].shape[0] <= n:
            grown = max(2 * self._k[layer].shape[0], n + 1)
            for buffers in (self._k, self._v):
                old = buffers[layer]
                buffers[layer] = self._buffer(grown)
                buffers[layer][:n] = old[:n]
        self._pend(layer, k, v)
        self._k[layer][n] = k
        self._v[layer][n] = v
        return (self._k[layer][:n + 1].transpose(0, 1),
                self._v[layer][:n + 1].transpose(0, 1))

    def apply(self, decision: Any) -> None:
        """Applies an accepted Decision of this step to every layer."""
        gone, new_evicted = self._evicted_indices(decision)
        n = len(self.positions)
        if gone or new_evicted:
            drop = set(gone)
            keep = [i for i in range(n) if i not in drop]
            if not new_evicted:
                keep.append(n)
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            for buffers in (self._k, self._v):
                for layer in range(self.layers):
                    buffers[layer][:len(keep)] = buffers[layer].index_select(0, index)
        self._commit(gone, new_evicted)


class KvPoolMapping:
    """One rank's host shared-memory KV pool of kvcached (``--pool_memory_bytes``,
    ``--backend=host``), mapped into this process as a torch tensor.

    ``blocks``: ``[capacity_blocks, layers, 2 (K, V), tokens_per_block, kv_heads,
    head_dim]`` of the pool's dtype, the layout of docs/GPU.md "Memory layout"; slot ``s``
    is token ``s % tokens_per_block`` of block ``s // tokens_per_block``. Writes land in the
    daemon's memory. ``close()`` (or the ``with``) unmaps it; the daemon owns and unlinks
    the object. Requires the daemon on this node, as this user (or root).
    """

    def __init__(self, pool: Any) -> None:
        """``pool``: a :class:`~kvcache_client.KvPool` (``client.describe_kv_pools()``)."""
        if pool.backend != "host" or not pool.shm_name:
            raise ValueError(f"rank {pool.rank}'s pool is not host shared memory "
                             f"(backend {pool.backend!r}, shm_name {pool.shm_name!r}): start "
                             "kvcached with --backend=host and --kv_shared_memory=true")
        self.pool = pool
        self.rank = pool.rank
        path = "/dev/shm/" + pool.shm_name.lstrip("/")
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap: Optional[mmap.mmap] = mmap.mmap(fd, pool.bytes, mmap.MAP_SHARED,
                                                        mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        dtype = _TORCH_DTYPES[pool.dtype]
        flat = torch.frombuffer(self._mmap, dtype=dtype,
                                count=pool.capacity_blocks * pool.block_bytes
                                // torch.empty((), dtype=dtype).element_size())
        self.blocks: Optional[Tensor] = flat.view(
            pool.capacity_blocks, pool.layers, 2, pool.tokens_per_block, pool.kv_heads,
            pool.head_dim)
        self.tokens_per_block = pool.tokens_per_block

    @classmethod
    def for_rank(cls, client: Any, rank: int = 0) -> "KvPoolMapping":
        """Maps ``rank``'s pool of the daemon ``client`` talks to."""
        for pool in client.describe_kv_pools():
            if pool.rank == rank:
                return cls(pool)
        raise ValueError(f"kvcached at {client.address} has no KV pool for rank {rank} "
                         "(start it with --pool_memory_bytes)")

    def close(self) -> None:
        """Unmaps the pool (tensors taken from ``blocks`` must be gone by then)."""
        self.blocks = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still alive: leave it mapped until collected
                pass
            self._mmap = None

    def __enter__(self) -> "KvPoolMapping":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class PooledKvCache(_StepState):
    """One sequence's K and V in the daemon's KV pool, addressed by its slot table.

    The daemon leased the prefill's slots at OpenSequence; :meth:`open` reads the slot
    table (``inspect(include_cache=True).kv_slots``), :meth:`load_prefill` writes the
    prefill's K/V there. A step: ``keys, values = cache.extend(layer, k, v)`` per layer
    gathers the cached tokens' K/V by slot and appends the new token's (kept aside: its slot
    comes with the decision); ``cache.apply(decision)`` drops the evicted tokens' slots,
    follows the compaction moves the daemon made (it moved the bytes; the table follows),
    and writes the new token's K/V at ``new_token_slot`` on every layer.
    """

    def __init__(self, mapping: KvPoolMapping, slots: Sequence[int],
                 positions: Sequence[int], *, next_position: Optional[int] = None) -> None:
        if len(slots) != len(positions):
            raise ValueError(f"{len(slots)} slots for {len(positions)} positions")
        super().__init__(mapping.pool.layers, positions,
                         next_position if next_position is not None
                         else (positions[-1] + 1 if positions else 0))
        self.mapping = mapping
        self.rank = mapping.rank
        self.slots: List[int] = [int(s) for s in slots]
        self._slot_index: Optional[Tuple[Tensor, Tensor]] = None

    @classmethod
    def open(cls, client: Any, mapping: KvPoolMapping, sequence_id: str) -> "PooledKvCache":
        """The cache of an open sequence, from the daemon's slot table for this rank."""
        state = client.inspect(sequence_id, include_cache=True)
        if mapping.rank not in state.kv_slots:
            raise ValueError(f"sequence {sequence_id!r} has no slots on rank {mapping.rank}")
        return cls(mapping, state.kv_slots[mapping.rank], state.positions,
                   next_position=state.prefill_len + state.last_step)

    def __len__(self) -> int:
        return len(self.positions)

    def _index(self) -> Tuple[Tensor, Tensor]:
        if self._slot_index is None:
            slots = torch.tensor(self.slots, dtype=torch.long)
            tpb = self.mapping.tokens_per_block
            self._slot_index = (slots // tpb, slots % tpb)
        return self._slot_index

    def load_prefill(self, keys: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        """Writes the cached tokens' K/V (per layer ``[kv_heads, n, d]``, in position
        order) into their slots."""
        blocks, toks = self._index()
        pool = self.mapping.blocks
        for layer in range(self.layers):
            pool[blocks, layer, 0, toks] = keys[layer].transpose(0, 1).to(pool.dtype)
            pool[blocks, layer, 1, toks] = values[layer].transpose(0, 1).to(pool.dtype)

    def _gather(self, layer: int, kv: int) -> Tensor:
        blocks, toks = self._index()
        return self.mapping.blocks[blocks, layer, kv, toks]  # [n, kv_heads, d], a copy

    def keys(self, layer: int) -> Tensor:
        """``[kv_heads, n, d]``: the cached keys of ``layer``, gathered by slot (a copy)."""
        return self._gather(layer, 0).transpose(0, 1)

    def values(self, layer: int) -> Tensor:
        return self._gather(layer, 1).transpose(0, 1)

    def extend(self, layer: int, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Gathers ``layer``'s cached K/V and appends the step's token: ``[kv_heads, n + 1,
        d]`` each (in the pool's dtype; token-major underneath, like DenseKvCache's)."""
        self._pend(layer, k, v)
        dtype = self.mapping.blocks.dtype
        keys = torch.cat([self._gather(layer, 0), k.to(dtype).unsqueeze(0)], dim=0)
        values = torch.cat([self._gather(layer, 1), v.to(dtype).unsqueeze(0)], dim=0)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def apply(self, decision: Any) -> None:
        """Applies an accepted Decision of this step (its ``kv_changes`` for this rank)."""
        gone, new_evicted = self._evicted_indices(decision)
        change = next((c for c in decision.kv_changes if c.rank == self.rank), None)
        if change is None:
            raise ValueError(f"step {decision.step} carries no KV change for rank "
                             f"{self.rank} (is the daemon holding KV pools?)")
        if (change.new_token_slot < 0) != new_evicted:
            raise ValueError(f"step {decision.step}: new_token_slot {change.new_token_slot} "
                             f"but the new token was {'' if new_evicted else 'not '}evicted")
        if gone:
            drop = set(gone)
            self.slots = [s for i, s in enumerate(self.slots) if i not in drop]
        if change.moves:
            moved = dict(change.moves)
            self.slots = [moved.get(s, s) for s in self.slots]
        if not new_evicted:
            slot = change.new_token_slot
            block, tok = divmod(slot, self.mapping.tokens_per_block)
            pool = self.mapping.blocks
            for layer, (k, v) in self._pending.items():
                pool[block, layer, 0, tok] = k.to(pool.dtype)
                pool[block, layer, 1, tok] = v.to(pool.dtype)
            self.slots.append(slot)
        self._slot_index = None
        self._commit(gone, new_evicted)


KvCache = Union[DenseKvCache, PooledKvCache]


# -- the decode loop -----------------------------------------------------------------------

class DecodeLoop:
    """Steps a :class:`~kvcache_client.SequenceBatch`'s sequences with their KV caches.

        loop = DecodeLoop(batch)
        loop.add("req-1", cache)                # an open sequence and its cache
        while generating:
            captures = loop.begin()             # {id: StepScores, or None: no capture}
            logits = model.decode(tokens, caches, captures)  # per layer: cache.extend(...)
            decisions = loop.finish(captures)   # sends, applies the decisions to the caches

    ``begin`` follows each sequence's ``next_needs_scores``: a step that needs no scores
    gets None, and the model skips the capture. Folded sequences get a capture that folds
    as it goes (their ``fold_weights``); a batch with a ``head_count`` (tensor-parallel
    rank) gets head-sum captures. ``stats`` adds up where the time went: ``capture_s``
    (inside the captures), ``step_s`` (packing and sending the reports and waiting for the
    decisions: the daemon round trip), ``apply_s`` (applying them to the caches).
    """

    def __init__(self, batch: Any, *, scorer: str = "attention",
                 dtype: Optional[str] = None) -> None:
        """``scorer``: see :data:`SCORERS`. ``dtype``: wire dtype of the scores (default:
        each sequence's ``score_dtype``)."""
        if scorer not in SCORERS:
            raise ValueError(f"unknown scorer {scorer!r}; use one of {SCORERS}")
        self.batch = batch
        self.scorer = scorer
        self.dtype = dtype
        self.caches: Dict[str, KvCache] = {}
        self.stats: Dict[str, float] = {"steps": 0, "scoring_steps": 0, "capture_s": 0.0,
                                        "step_s": 0.0, "apply_s": 0.0}

    def add(self, sequence_id: str, cache: KvCache) -> None:
        """Steps ``sequence_id`` (tracked by the batch) with ``cache`` from now on."""
        if sequence_id not in self.batch:
            raise KeyError(f"sequence {sequence_id!r} is not in the batch; open() it first")
        self.caches[sequence_id] = cache

    def remove(self, sequence_id: str) -> None:
        self.caches.pop(sequence_id, None)

    def begin(self) -> Dict[str, Optional[StepScores]]:
        """The captures of the next step: a :class:`StepScores` for each sequence whose
        step needs scores, None for the others."""
        captures: Dict[str, Optional[StepScores]] = {}
        for sequence_id in self.caches:
            tracked = self.batch.sequences[sequence_id]
            if not tracked.next_needs_scores:
                captures[sequence_id] = None
                continue
            captures[sequence_id] = StepScores(
                scorer=self.scorer, head_sum=bool(tracked.head_count),
                fold_weights=tracked.fold_weights if tracked.folded else None)
        return captures

    def finish(self, captures: Mapping[str, Optional[StepScores]]) -> Dict[str, Any]:
        """Sends the step of every sequence in ``captures`` and applies the decisions to
        their caches; returns the decisions. Raises StepError (nothing applied) when the
        daemon rejects one."""
        start = time.perf_counter()
        reports = {sid: (None if c is None else c.report()) for sid, c in captures.items()}
        built = time.perf_counter()
        decisions = self.batch.step(reports, dtype=self.dtype, raise_on_error=True)
        sent = time.perf_counter()
        for sequence_id, decision in decisions.items():
            self.caches[sequence_id].apply(decision)
        done = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["scoring_steps"] += any(c is not None for c in captures.values())
        self.stats["capture_s"] += sum(c.seconds for c in captures.values() if c is not None)
        self.stats["step_s"] += sent - built
        self.stats["apply_s"] += done - sent
        return decisions
