"""What the daemon answers: sequence snapshots, their statistics, and step decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import grpc

from ._proto import dtype_from_proto, layout_from_proto, pb
from .errors import StepError, status_code
from .fold import FoldWeights
from .policy import Policy


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
        )


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
    device: int

    @classmethod
    def from_proto(cls, m: pb.KvPool) -> "KvPool":
        backend = {pb.KV_BACKEND_HOST: "host", pb.KV_BACKEND_CUDA: "cuda"}.get(m.backend, "")
        return cls(m.rank, backend, m.tokens_per_block, m.layers, m.kv_heads, m.head_dim,
                   dtype_from_proto(m.dtype), m.block_bytes, m.capacity_blocks,
                   m.used_blocks, m.bytes, m.shm_name, m.cuda_ipc_handle, m.device)


@dataclass(frozen=True)
class Decision:
    """The outcome of one sequence's step.

    When ``ok``: evict ``evicted`` (positions, ascending) from every layer, head and rank;
    the cache then holds ``cache_size`` tokens, and ``next_needs_scores`` says whether the
    next step must carry scores. Otherwise the step was rejected, nothing changed, and
    ``code``/``message`` say why; the same step may be sent again.
    """

    sequence_id: str
    step: int
    code: grpc.StatusCode
    message: str
    evicted: List[int]
    cache_size: int
    next_needs_scores: bool
    kv_changes: List[KvChange] = field(default_factory=list)  #: per rank, with KV pools

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def raise_for_status(self) -> "Decision":
        """Raises StepError unless ``ok``; returns the decision for chaining."""
        if not self.ok:
            raise StepError(self.sequence_id, self.step, self.code, self.message)
        return self

    @classmethod
    def from_proto(cls, message: pb.Decision) -> "Decision":
        return cls(message.sequence_id, message.step, status_code(message.code),
                   message.message, list(message.evicted), message.cache_size,
                   message.next_needs_scores,
                   [KvChange.from_proto(k) for k in message.kv_changes])

    @classmethod
    def rejected(cls, sequence_id: str, step: int, code: grpc.StatusCode, message: str,
                 cache_size: int, next_needs_scores: bool) -> "Decision":
        """A rejection made on this side (the report was not sent; the state is unchanged)."""
        return cls(sequence_id, step, code, message, [], cache_size, next_needs_scores)
