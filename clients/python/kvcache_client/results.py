"""What the daemon answers: sequence snapshots, their statistics, and step decisions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc

from . import masks
from ._proto import dtype_from_proto, encoding_from_proto, layout_from_proto, pb
from .errors import StepError, status_code
from .fold import FoldWeights
from .policy import Policy

__all__ = ["CreatedScoreRegion", "Decision", "ImportedSequence", "KvChange", "KvPool",
           "SequenceState", "SequenceStats"]


@dataclass(frozen=True)
class SequenceStats:
    """A sequence's totals."""

    steps: int = 0
    scoring_steps: int = 0
    skipped_scoring_steps: int = 0  #: steps a score-using policy needed no scores for
    ignored_score_reports: int = 0  #: steps that carried scores nobody needed
    tokens_evicted: int = 0

    @classmethod
    def from_proto(cls, message: pb.SequenceStats) -> "SequenceStats":
        return cls(message.steps, message.scoring_steps, message.skipped_scoring_steps,
                   message.ignored_score_reports, message.tokens_evicted)


@dataclass(frozen=True)
class SequenceState:
    """A snapshot of one open sequence."""

    sequence_id: str
    prefill_len: int
    budget: int                 #: the most tokens the cache holds after a step
    policy: Policy              #: resolved: a preset's fields filled in
    tp_world_size: int
    score_dtype: str            #: float32, float16 or bfloat16
    last_step: int              #: 0 before the first step
    cache_size: int
    next_needs_scores: bool     #: whether step last_step + 1 must carry scores
    ranks_reported: int         #: tensor-parallel ranks that reported the pending step
    stats: SequenceStats
    idle_seconds: float
    positions: List[int] = field(default_factory=list)  #: with include_cache, ascending
    momentum: List[float] = field(default_factory=list)  #: with include_cache
    #: with include_cache and KV pools: rank -> each cached token's slot (order of positions)
    kv_slots: Dict[int, List[int]] = field(default_factory=dict)
    score_layout: str = "per_layer"  #: per_layer, or folded (one row per scoring step)
    layers: int = 0                  #: folded: the K layers each folded row sums
    #: folded with a score-using aggregation: the weights for fold_scores, and the decay
    fold_weights: Optional[FoldWeights] = None
    #: how its decisions travel: positions, mask, or auto (per decision the smaller)
    decision_encoding: str = "positions"

    @property
    def next_step(self) -> int:
        return self.last_step + 1

    @classmethod
    def from_proto(cls, message: pb.SequenceState) -> "SequenceState":
        return cls(
            sequence_id=message.sequence_id,
            prefill_len=message.prefill_len,
            budget=message.budget,
            policy=Policy.from_proto(message.policy),
            tp_world_size=message.tp_world_size or 1,
            score_dtype=dtype_from_proto(message.score_dtype),
            last_step=message.last_step,
            cache_size=message.cache_size,
            next_needs_scores=message.next_needs_scores,
            ranks_reported=message.ranks_reported,
            stats=SequenceStats.from_proto(message.stats),
            idle_seconds=message.idle_seconds,
            positions=list(message.positions),
            momentum=list(message.momentum),
            kv_slots={s.rank: list(s.slots) for s in message.kv_slots},
            score_layout=layout_from_proto(message.score_layout),
            layers=message.layers,
            fold_weights=(FoldWeights.from_proto(message.fold_weights)
                          if message.HasField("fold_weights") else None),
            decision_encoding=encoding_from_proto(message.decision_encoding),
        )


@dataclass(frozen=True)
class ImportedSequence:
    """A sequence this daemon took over from another (KvCacheClient.import_sequence).

    ``state`` is the sequence as it is open here now: same id, tenant and step as at the
    source, with ``positions`` and, with KV pools, ``kv_slots`` (per rank, this node's slot
    of each cached token, in the order of ``positions``): the slot table a worker continues
    from (``PooledKvCache.adopt``). The next step is ``state.next_step``.
    """

    state: SequenceState
    kv_bytes: int      #: K/V bytes moved (whole blocks of every rank); 0 without KV pools
    record_bytes: int  #: the engine state's bytes
    transport: str     #: "ucx", "grpc", or "none" (no KV pools)
    seconds: float     #: from the export's start to the commit

    @property
    def sequence_id(self) -> str:
        return self.state.sequence_id

    @property
    def bytes_moved(self) -> int:
        """Everything the hand-off moved between the daemons: K/V and engine state."""
        return self.kv_bytes + self.record_bytes

    @classmethod
    def from_proto(cls, message: "pb.ImportSequenceResponse") -> "ImportedSequence":
        return cls(SequenceState.from_proto(message.state), message.kv_bytes,
                   message.record_bytes, message.transport, message.seconds)


@dataclass(frozen=True)
class KvChange:
    """What a step did to one rank's KV slots (when kvcached holds KV pools).

    Write the step's token's K and V to ``new_token_slot`` (-1: it was evicted in its own
    step). ``moves`` are (from_slot, to_slot) pairs whose K/V the daemon moved while
    compacting: update your slot table. ``released_blocks`` went back to the pool.
    """

    rank: int
    new_token_slot: int
    moves: List[Tuple[int, int]]
    released_blocks: List[int]

    @classmethod
    def from_proto(cls, message: pb.KvChange) -> "KvChange":
        return cls(message.rank, message.new_token_slot,
                   list(zip(message.moved_from, message.moved_to)),
                   list(message.released_blocks))


@dataclass(frozen=True)
class KvPool:
    """One rank's KV block pool (KvCacheClient.describe_kv_pools).

    Blocks are [layers][K, V][tokens_per_block][kv_heads][head_dim] of ``dtype``; block b
    starts at b * block_bytes. Map host pools with shm_open(shm_name) and mmap(bytes).
    """

    rank: int
    backend: str  #: host or cuda
    tokens_per_block: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_bytes: int
    capacity_blocks: int
    used_blocks: int
    bytes: int
    shm_name: str
    cuda_ipc_handle: bytes
    device: int                 #: the daemon's CUDA ordinal; match the GPU by the next two
    device_uuid: str = ""       #: cuda: "GPU-..." (nvidia-smi -L, CUDA_VISIBLE_DEVICES)
    device_pci_bus_id: str = ""  #: cuda: "0000:18:00.0"
    #: cuda: why the pool has no IPC handle (exclusive-process GPU, no CUDA IPC); "" if it has
    export_unavailable: str = ""

    @classmethod
    def from_proto(cls, m: pb.KvPool) -> "KvPool":
        backend = {pb.KV_BACKEND_HOST: "host", pb.KV_BACKEND_CUDA: "cuda"}.get(m.backend, "")
        return cls(m.rank, backend, m.tokens_per_block, m.layers, m.kv_heads, m.head_dim,
                   dtype_from_proto(m.dtype), m.block_bytes, m.capacity_blocks,
                   m.used_blocks, m.bytes, m.shm_name, m.cuda_ipc_handle, m.device,
                   m.device_uuid, m.device_pci_bus_id,
                   getattr(m, "export_unavailable", ""))


@dataclass(frozen=True)
class CreatedScoreRegion:
    """A score region kvcached created (KvCacheClient.create_score_region).

    ``backend`` "host": a POSIX shared-memory object of the daemon's, ``shm_name``, mapped
    read-write with shm_open and mmap(``bytes``). "cuda": device memory on the daemon's
    engine GPU, to open with cudaIpcOpenMemHandle (``cuda_ipc_handle``) on this process's
    ordinal of the GPU at ``device_pci_bus_id`` whose UUID is ``device_uuid``.
    :class:`ScoreRegion` with ``from_daemon=True`` maps either kind.
    """

    region: int
    backend: str  #: host or cuda
    bytes: int
    shm_name: str
    cuda_ipc_handle: bytes
    device: int                 #: the daemon's CUDA ordinal; match the GPU by the next two
    device_uuid: str = ""
    device_pci_bus_id: str = ""

    @classmethod
    def from_proto(cls, m: "pb.CreateScoreRegionResponse") -> "CreatedScoreRegion":
        backend = {pb.KV_BACKEND_HOST: "host", pb.KV_BACKEND_CUDA: "cuda"}.get(m.backend, "")
        return cls(m.region, backend, m.bytes, m.shm_name, m.cuda_ipc_handle, m.device,
                   m.device_uuid, m.device_pci_bus_id)


@dataclass(frozen=True)
class Decision:
    """The outcome of one sequence's step.

    When ``ok``: evict ``evicted`` (positions, ascending) from every layer, head and rank;
    the cache then holds ``cache_size`` tokens, and ``next_needs_scores`` says whether the
    next step must carry scores. Otherwise the step was rejected, nothing changed, and
    ``code``/``message`` say why; the same step may be sent again.

    The same eviction as a mask: :meth:`keep_mask`. Whichever form the daemon sent (the
    sequence's ``decision_encoding``; ``encoding`` says which this one came in), a
    :class:`~kvcache_client.batch.SequenceBatch` gives both, since it tracks the cache's
    positions. A mask decision from a raw :class:`~kvcache_client.stream.StepStream` or
    ``KvCacheClient.step`` has ``evicted`` None until :meth:`with_cache` is given the cache.
    """

    sequence_id: str
    step: int
    code: grpc.StatusCode
    message: str
    evicted: Optional[List[int]]
    cache_size: int
    next_needs_scores: bool
    kv_changes: List[KvChange] = field(default_factory=list)  #: per rank, with KV pools
    #: a mask decision's bits (see kvcache_client.masks) and how many; 0: it came as positions
    mask_tokens: int = 0
    evicted_mask: bytes = field(default=b"", repr=False)
    #: the evicted tokens' indices into the cache before eviction, once resolved
    _evicted_indices: Any = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    @property
    def encoding(self) -> str:
        """How this decision travelled: ``"mask"`` or ``"positions"``."""
        return "mask" if self.mask_tokens else "positions"

    @property
    def tokens_before(self) -> int:
        """The cache before eviction plus the new token: the length of :meth:`keep_mask`."""
        return self.mask_tokens or self.cache_size + len(self.evicted or ())

    def keep_mask(self, like: Any = None) -> Any:
        """Which tokens stay: one bool per token of the cache before eviction, in ascending
        position order, then the step's new token (``tokens_before`` entries); True = kept.

        A numpy bool array (a list of bools without numpy); ``like=tensor`` gives a
        ``torch.bool`` tensor on that tensor's device (``like=ndarray``: numpy). Available
        from a mask decision, from one that evicted nothing, and from any decision of a
        SequenceBatch; a positions decision from a raw stream needs :meth:`with_cache`
        first (ValueError otherwise).
        """
        self.raise_for_status()
        if self.mask_tokens:
            keep = masks.keep_from_mask(self.evicted_mask, self.mask_tokens)
        elif self._evicted_indices is not None or not self.evicted:
            keep = masks.keep_from_indices(self.tokens_before, self._evicted_indices)
        else:
            raise ValueError(
                f"sequence {self.sequence_id!r} step {self.step}: keep_mask() of a positions "
                "decision needs the cache it applies to: step through a SequenceBatch, or "
                "call with_cache(positions before eviction + the new token) first")
        return masks.as_tensor_like(keep, like)

    def with_cache(self, cache: Sequence[int]) -> "Decision":
        """This decision with both forms: ``cache`` is the positions before eviction,
        ascending, then the step's new token (a list or a numpy int64 array). A rejected
        decision comes back as it is. ValueError when the decision does not fit ``cache``."""
        if not self.ok:
            return self
        return dataclasses.replace(self)._resolve(cache)

    def _resolve(self, cache: Sequence[int]) -> "Decision":
        """with_cache in place, for a decision not handed out yet (SequenceBatch.step)."""
        evicted, indices = masks.resolve(self.sequence_id, self.step, self.evicted,
                                         self.evicted_mask, self.mask_tokens, self.cache_size,
                                         cache)
        object.__setattr__(self, "evicted", evicted)
        object.__setattr__(self, "_evicted_indices", indices)
        return self

    def raise_for_status(self) -> "Decision":
        """Raises StepError unless ``ok``; returns the decision for chaining."""
        if not self.ok:
            raise StepError(self.sequence_id, self.step, self.code, self.message)
        return self

    @classmethod
    def from_proto(cls, message: pb.Decision) -> "Decision":
        mask_tokens = message.mask_tokens
        return cls(message.sequence_id, message.step, status_code(message.code),
                   message.message, None if mask_tokens else list(message.evicted),
                   message.cache_size, message.next_needs_scores,
                   [KvChange.from_proto(k) for k in message.kv_changes],
                   mask_tokens=mask_tokens, evicted_mask=message.evicted_mask)

    @classmethod
    def rejected(cls, sequence_id: str, step: int, code: grpc.StatusCode, message: str,
                 cache_size: int, next_needs_scores: bool) -> "Decision":
        """A rejection made on this side (the report was not sent; the state is unchanged)."""
        return cls(sequence_id, step, code, message, [], cache_size, next_needs_scores)
