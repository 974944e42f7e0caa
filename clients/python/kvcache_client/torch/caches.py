"""KV caches that apply kvcached's decisions: the worker's own tensors (DenseKvCache) or
the daemon's KV pool, host shared memory or a GPU's memory (KvPoolMapping, PooledKvCache).

Not thread-safe: a cache belongs to one worker thread.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}

Tensor = torch.Tensor


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
    """One rank's KV pool of kvcached (``--pool_memory_bytes``), mapped into this process as
    a torch tensor: a host shared-memory pool (``--backend=host``) by mmap, a CUDA pool
    (``--backend=cuda``) by its CUDA IPC handle on this process's ordinal of the pool's GPU
    (found by PCI bus id, checked by UUID: :mod:`kvcache_client.cuda_runtime`).

    ``blocks``: ``[capacity_blocks, layers, 2 (K, V), tokens_per_block, kv_heads,
    head_dim]`` of the pool's dtype, the layout of docs/GPU.md "Memory layout"; slot ``s``
    is token ``s % tokens_per_block`` of block ``s // tokens_per_block``. ``device`` says
    where it lives (``cpu``, or ``cuda:N`` in this process's numbering). Writes land in the
    daemon's memory. Requires the daemon on this node, as this user (or root).

    ``close()`` (or the ``with``) drops ``blocks`` and then unmaps (closes the IPC handle);
    tensors taken from ``blocks`` must be gone by then. The daemon owns the memory and
    frees it when it exits (it never retires a pool while it runs): close the mapping
    before the daemon is stopped. A CUDA mapping of a daemon that exited is device memory
    freed under it (CUDA leaves its use undefined); a host mapping keeps the unlinked
    object's pages, no longer the daemon's. After a restart, map the new daemon's pools.
    """

    def __init__(self, pool: Any) -> None:
        """``pool``: a :class:`~kvcache_client.KvPool` (``client.describe_kv_pools()``)."""
        self.pool = pool
        self.rank = pool.rank
        self.tokens_per_block = pool.tokens_per_block
        self._mmap: Optional[mmap.mmap] = None
        self._ipc: Any = None  # cuda_runtime.IpcMapping of a CUDA pool
        if pool.backend == "cuda" and not pool.cuda_ipc_handle:
            why = getattr(pool, "export_unavailable", "") or "the daemon sent no IPC handle"
            raise ValueError(f"rank {pool.rank}'s CUDA KV pool cannot be mapped by a worker: "
                             f"{why}; keep K/V in the worker's own tensors (DenseKvCache)")
        if pool.backend == "cuda":
            raw = self._map_device(pool)
        elif pool.backend == "host" and pool.shm_name:
            raw = self._map_host(pool)
        else:
            raise ValueError(f"rank {pool.rank}'s pool is neither host shared memory nor "
                             f"CUDA device memory (backend {pool.backend!r}, shm_name "
                             f"{pool.shm_name!r}): start kvcached with --backend=host "
                             "--kv_shared_memory=true, or --backend=cuda")
        dtype = _TORCH_DTYPES[pool.dtype]
        used = pool.capacity_blocks * pool.block_bytes  # a CUDA pool's bytes are rounded up
        if used > raw.numel():
            self.close()
            raise ValueError(f"rank {pool.rank}'s pool maps {raw.numel()} bytes, below its "
                             f"{pool.capacity_blocks} blocks of {pool.block_bytes} bytes")
        self.blocks: Optional[Tensor] = raw[:used].view(dtype).view(
            pool.capacity_blocks, pool.layers, 2, pool.tokens_per_block, pool.kv_heads,
            pool.head_dim)
        self.device: torch.device = self.blocks.device

    def _map_host(self, pool: Any) -> Tensor:
        path = "/dev/shm/" + pool.shm_name.lstrip("/")
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, pool.bytes, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return torch.frombuffer(self._mmap, dtype=torch.uint8)

    def _map_device(self, pool: Any) -> Tensor:
        from .. import cuda_runtime  # loads CUDA: only for a pool in device memory
        from ..errors import KvCacheError
        try:
            self._ipc = cuda_runtime.open_ipc_export(pool)
        except KvCacheError as error:
            raise KvCacheError(error.code, f"rank {pool.rank}'s KV pool: {error.message}") \
                from None
        try:
            return self._ipc.as_tensor()
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_rank(cls, client: Any, rank: int = 0) -> "KvPoolMapping":
        """Maps ``rank``'s pool of the daemon ``client`` talks to."""
        for pool in client.describe_kv_pools():
            if pool.rank == rank:
                return cls(pool)
        raise ValueError(f"kvcached at {client.address} has no KV pool for rank {rank} "
                         "(start it with --pool_memory_bytes)")

    def close(self) -> None:
        """Drops ``blocks``, then unmaps the pool (tensors taken from ``blocks`` must be
        gone by then: a CUDA one would point at an unmapped range). Idempotent."""
        self.blocks = None
        if self._ipc is not None:
            ipc, self._ipc = self._ipc, None
            ipc.close()
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
    prefill's K/V there. A sequence the daemon imported from another node (disaggregated
    serving) comes with its K/V already in this pool: :meth:`adopt` takes the slot table
    from the import's answer. A step: ``keys, values = cache.extend(layer, k, v)`` per layer
    gathers the cached tokens' K/V by slot and appends the new token's (kept aside: its slot
    comes with the decision); ``cache.apply(decision)`` drops the evicted tokens' slots,
    follows the compaction moves the daemon made (it moved the bytes in the pool, on the
    GPU for a CUDA pool, before it answered; the table follows), and writes the new token's
    K/V at ``new_token_slot`` on every layer.

    The pool may be host memory or a GPU's (``mapping.device``); the K/V given must be on
    that device (ValueError otherwise). On a GPU every pool access is queued on the current
    stream without a host round trip (the slot indices go to the device once per step),
    except one wait: the daemon moves tokens in place once it has a step's report, so the
    last layer's :meth:`extend` waits until this cache's reads and writes of the pool so far
    have run (:meth:`synchronize`), on the streams they were queued on only.
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
        self._streams: Dict[Any, None] = {}  # CUDA streams with pool accesses not waited for

    @classmethod
    def open(cls, client: Any, mapping: KvPoolMapping, sequence_id: str) -> "PooledKvCache":
        """The cache of an open sequence, from the daemon's slot table for this rank."""
        state = client.inspect(sequence_id, include_cache=True)
        return cls._from_state(mapping, state)

    @classmethod
    def adopt(cls, mapping: KvPoolMapping, imported: Any) -> "PooledKvCache":
        """The cache of a sequence this node's daemon imported from another
        (``client.import_sequence``, docs/DISAGGREGATION.md): ``imported`` is the
        :class:`~kvcache_client.ImportedSequence` (or its ``state``); ``mapping`` this
        node's pool of the worker's rank. The daemon copied the kept tokens' K/V into
        that pool, at the slots of ``state.kv_slots``; the cache reads them there and
        continues at the step after the source's last (``next_position``). Nothing is
        loaded: there is no ``load_prefill`` after an adoption. ValueError when the state
        has no slot table for this rank (the daemons hold no KV pools) or a slot lies
        outside this pool (a mapping of another daemon)."""
        state = getattr(imported, "state", imported)
        cache = cls._from_state(mapping, state)
        capacity = mapping.pool.capacity_blocks * mapping.tokens_per_block
        outside = [s for s in cache.slots if not 0 <= s < capacity]
        if outside:
            raise ValueError(f"sequence {state.sequence_id!r}: slots {outside[:4]} lie outside "
                             f"rank {mapping.rank}'s pool ({capacity} slots): map the pool of "
                             "the daemon that imported it")
        return cache

    @classmethod
    def _from_state(cls, mapping: KvPoolMapping, state: Any) -> "PooledKvCache":
        if mapping.rank not in state.kv_slots:
            raise ValueError(f"sequence {state.sequence_id!r} has no slots on rank "
                             f"{mapping.rank} (is the daemon holding KV pools?)")
        return cls(mapping, state.kv_slots[mapping.rank], state.positions,
                   next_position=state.prefill_len + state.last_step)

    def __len__(self) -> int:
        return len(self.positions)

    def _pool(self) -> Tensor:
        """The mapping's ``blocks``, noting the stream its next access is queued on."""
        pool = self.mapping.blocks
        if pool is None:
            raise ValueError(f"rank {self.rank}'s KV pool mapping is closed")
        if pool.is_cuda:
            self._streams[torch.cuda.current_stream(pool.device)] = None
        return pool

    def _check_device(self, pool: Tensor, what: str, tensors: Sequence[Tensor]) -> None:
        for tensor in tensors:
            if tensor.device != pool.device:
                raise ValueError(f"{what} is on {tensor.device}, rank {self.rank}'s KV pool "
                                 f"on {pool.device}: compute on the pool's device")

    def _index(self, pool: Tensor) -> Tuple[Tensor, Tensor]:
        """(block, token in block) of each slot: built once per step on the pool's device."""
        if self._slot_index is None:
            slots = torch.tensor(self.slots, dtype=torch.long)
            if pool.is_cuda:  # from pinned memory: queued on the stream, not waited for
                slots = slots.pin_memory().to(pool.device, non_blocking=True)
            tpb = self.mapping.tokens_per_block
            self._slot_index = (slots // tpb, slots % tpb)
        return self._slot_index

    def load_prefill(self, keys: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        """Writes the cached tokens' K/V (per layer ``[kv_heads, n, d]``, in position
        order, on the pool's device) into their slots."""
        pool = self._pool()
        self._check_device(pool, "the prefill's K/V", [*keys, *values])
        blocks, toks = self._index(pool)
        for kv, given in ((0, keys), (1, values)):
            # [n, layers, kv_heads, d]: every layer's tokens in one indexed write
            pool[blocks, :, kv, toks] = torch.stack(
                [t.transpose(0, 1) for t in given], dim=1).to(pool.dtype)

    def _gather(self, layer: int, kv: int) -> Tensor:
        pool = self._pool()
        blocks, toks = self._index(pool)
        return pool[blocks, layer, kv, toks]  # [n, kv_heads, d], a copy

    def keys(self, layer: int) -> Tensor:
        """``[kv_heads, n, d]``: the cached keys of ``layer``, gathered by slot (a copy)."""
        return self._gather(layer, 0).transpose(0, 1)

    def values(self, layer: int) -> Tensor:
        return self._gather(layer, 1).transpose(0, 1)

    def extend(self, layer: int, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Gathers ``layer``'s cached K/V and appends the step's token: ``[kv_heads, n + 1,
        d]`` each (in the pool's dtype; token-major underneath, like DenseKvCache's). The
        step's last layer then waits for this cache's pool accesses (:meth:`synchronize`)."""
        pool = self._pool()
        self._check_device(pool, f"layer {layer}'s new K/V", (k, v))
        self._pend(layer, k, v)
        keys = torch.cat([self._gather(layer, 0), k.to(pool.dtype).unsqueeze(0)], dim=0)
        values = torch.cat([self._gather(layer, 1), v.to(pool.dtype).unsqueeze(0)], dim=0)
        if len(self._pending) == self.layers:  # the step's report may leave next
            self.synchronize()
        return keys.transpose(0, 1), values.transpose(0, 1)

    def synchronize(self) -> None:
        """Waits until this cache's reads and writes of a CUDA pool queued so far have run
        (their streams only; nothing to wait for on a host pool). :meth:`extend` calls it
        at each step's last layer; call it before the daemon reads the pool otherwise (an
        export to another node after :meth:`apply` or :meth:`load_prefill`)."""
        streams, self._streams = self._streams, {}
        for stream in streams:
            stream.synchronize()

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
            pool = self._pool()
            for kv in (0, 1):  # [layers, kv_heads, d] into the slot, every layer at once
                pool[block, :, kv, tok] = torch.stack(
                    [self._pending[layer][kv] for layer in range(self.layers)]).to(pool.dtype)
            self.slots.append(slot)
        self._slot_index = None
        self._commit(gone, new_evicted)


KvCache = Union[DenseKvCache, PooledKvCache]
