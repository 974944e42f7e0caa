"""KvCacheClient: a connection to kvcached and its unary calls."""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from ._proto import dtype_to_proto, encoding_to_proto, layout_to_proto, pb, pb_grpc
from .batch import SequenceBatch
from .credentials import TlsConfig, make_channel, read_token_file
from .errors import KvCacheError
from .policy import Policy
from .region import ScoreRegion
from .results import (CreatedScoreRegion, Decision, ImportedSequence, KvPool, SequenceState,
                      SequenceStats)
from .scores import normalize_dtype
from .stream import ReportLike, StepStream, check_max_inflight, reports_to_proto

__all__ = ["KvCacheClient"]

PolicyLike = Union[Policy, str, Mapping[str, Any], None]


class KvCacheClient:
    """A channel to one kvcached (``"host:port"``), e.g. ``KvCacheClient("127.0.0.1:50051")``.

    Unary calls raise :class:`KvCacheError` (``.code`` is a grpc.StatusCode) when they fail.
    The step path is :meth:`batch` (or the lower-level :meth:`stream`); :meth:`step` is a
    unary alternative for simple clients. Use it as a context manager, or call
    :meth:`close`. Thread-safe (gRPC channels are); batches and streams are not.
    """

    def __init__(self, address: str, *, timeout: Optional[float] = None,
                 options: Sequence[Tuple[str, Any]] = (),
                 channel: Optional[grpc.Channel] = None,
                 tls: Optional[TlsConfig] = None, token: Optional[str] = None,
                 token_file: Optional[str] = None) -> None:
        """``timeout``: seconds per call (and per step reply of batches), None: no limit.
        ``options``: gRPC channel options, e.g. ``[("grpc.max_send_message_length", n)]``.
        ``tls``: a :class:`TlsConfig` for a daemon run with ``--tls_cert_file`` (None:
        plaintext). ``token`` or ``token_file`` (a file holding it): the bearer token of
        this client's tenant, for a daemon run with ``--auth_tokens_file``; sent on every
        call. ``channel``: use this channel as it is instead (``tls`` and the token must
        then be None).
        Raises ValueError for unreadable files, or ``token`` and ``token_file`` together."""
        if token is not None and token_file is not None:
            raise ValueError("give one of token and token_file, not both")
        if channel is not None and (tls is not None or token is not None
                                    or token_file is not None):
            raise ValueError("channel is used as it is: give tls and the token to it instead")
        if token_file is not None:
            token = read_token_file(token_file)
        self.address = address
        self.timeout = timeout
        self._channel = channel if channel is not None else make_channel(
            address, tls=tls, token=token, options=options)
        self._stub = pb_grpc.KvCacheStub(self._channel)

    # -- sequences ------------------------------------------------------------------------

    def open_sequence(self, sequence_id: str, prefill_len: int, *,
                      budget_tokens: Optional[int] = None,
                      compression_ratio: Optional[float] = None,
                      policy: PolicyLike = "inertia", tp_world_size: int = 1,
                      score_dtype: str = "float32", score_layout: str = "per_layer",
                      layers: Optional[int] = None,
                      decision_encoding: str = "positions",
                      resume: Optional[Tuple[int, Sequence[int]]] = None) -> SequenceState:
        """Registers a sequence: ``prefill_len`` prompt tokens and a budget, given as exactly
        one of ``budget_tokens`` (tokens kept) or ``compression_ratio`` (0.9 keeps 10%).

        ``policy``: a preset name (inertia, inertia_lazy4, score_free, tova, h2o,
        streaming_llm, random), a :class:`Policy`, or a mapping of its fields.
        ``score_dtype``: what its reports carry unless they say otherwise.
        ``score_layout``: ``"per_layer"`` (one row per layer) or ``"folded"`` (one row per
        step, the ``layers`` = K layer rows folded with the returned state's
        ``fold_weights``: see :func:`~kvcache_client.fold_scores`).
        ``decision_encoding``: how its decisions travel: ``"positions"`` (the evicted
        positions), ``"mask"`` (a bit mask over the cache before eviction: smaller when a
        step evicts many, e.g. a long prefill's first step) or ``"auto"`` (per decision
        the smaller). A :class:`SequenceBatch` gives ``Decision.evicted`` and
        ``Decision.keep_mask()`` from any of them (docs/PYTHON.md, "Decision encodings").
        ``resume``: ``(last_step, cached_positions)`` re-creates a sequence the daemon lost
        (it was killed without a snapshot): decoding continues at ``last_step + 1`` with
        those positions (ascending) cached; the other arguments are those it was first
        opened with (docs/SPEC.md, "Resuming a sequence").
        Raises KvCacheError: ALREADY_EXISTS, INVALID_ARGUMENT (budget, policy, layers),
        RESOURCE_EXHAUSTED (the daemon's --max_sequences).
        """
        if budget_tokens is not None and compression_ratio is not None:
            raise ValueError("give one of budget_tokens and compression_ratio, not both")
        request = pb.OpenSequenceRequest(
            sequence_id=sequence_id, prefill_len=prefill_len,
            policy=Policy.coerce(policy).to_proto(), tp_world_size=tp_world_size,
            score_dtype=dtype_to_proto(normalize_dtype(score_dtype)),
            score_layout=layout_to_proto(score_layout),
            decision_encoding=encoding_to_proto(decision_encoding))
        if layers is not None:
            request.layers = layers
        if budget_tokens is not None:
            request.budget_tokens = budget_tokens
        if compression_ratio is not None:
            request.compression_ratio = compression_ratio
        if resume is not None:
            last_step, cached_positions = resume
            request.resume.last_step = int(last_step)
            request.resume.cached_positions.extend(int(p) for p in cached_positions)
        response = self._call(self._stub.OpenSequence, request,
                              f"OpenSequence({sequence_id!r})")
        return SequenceState.from_proto(response.state)

    def close_sequence(self, sequence_id: str) -> SequenceStats:
        """Forgets a sequence; returns its totals. Raises KvCacheError NOT_FOUND."""
        response = self._call(self._stub.CloseSequence,
                              pb.CloseSequenceRequest(sequence_id=sequence_id),
                              f"CloseSequence({sequence_id!r})")
        return SequenceStats.from_proto(response.stats)

    def inspect(self, sequence_id: str, include_cache: bool = False) -> SequenceState:
        """A snapshot; with ``include_cache``, its cached positions and their momentum."""
        response = self._call(
            self._stub.InspectSequence,
            pb.InspectSequenceRequest(sequence_id=sequence_id, include_cache=include_cache),
            f"InspectSequence({sequence_id!r})")
        return SequenceState.from_proto(response.state)

    def import_sequence(self, sequence_id: str, source: str, *,
                        timeout: Optional[float] = None) -> ImportedSequence:
        """Moves an open sequence from the kvcached at ``source`` (``"host:port"`` or
        ``"unix:/path"``, as this daemon reaches it) into this one: disaggregated serving,
        a decode worker taking over what a prefill node stepped (docs/DISAGGREGATION.md).

        The daemon pulls the sequence's engine state and K/V blocks and opens it here under
        the same id and tenant at the same step; the source closes it once this daemon holds
        it. Returns an :class:`ImportedSequence`: its ``state`` (positions, and each rank's
        slot table ``kv_slots`` with KV pools), ``kv_bytes``, ``record_bytes``,
        ``transport`` and ``seconds``. Decode on at ``state.next_step``, on this daemon.
        ``timeout``: seconds for this call (default: the client's).

        Until the import commits the source keeps serving the sequence unchanged (its steps
        are refused while the export is in progress); a failed import leaves nothing here.
        Raises KvCacheError: NOT_FOUND (the source has no such sequence of this tenant),
        ALREADY_EXISTS (open here), FAILED_PRECONDITION (a pending tensor-parallel step, a
        hand-off already under way, or the two daemons' KV pools differ), UNAVAILABLE
        (the source cannot be reached or failed mid-transfer), RESOURCE_EXHAUSTED (this
        daemon's import limits, sequences or pools).
        """
        response = self._call(
            self._stub.ImportSequence,
            pb.ImportSequenceRequest(sequence_id=sequence_id, source=source),
            f"ImportSequence({sequence_id!r} from {source})", timeout=timeout)
        return ImportedSequence.from_proto(response)

    def describe_kv_pools(self) -> List[KvPool]:
        """The daemon's KV block pools, one per rank (empty unless it holds pools)."""
        response = self._call(self._stub.DescribeKvPools, pb.DescribeKvPoolsRequest(),
                              "DescribeKvPools")
        return [KvPool.from_proto(p) for p in response.pools]

    def list_sequences(self) -> List[SequenceState]:
        """Snapshots of every open sequence (without their caches)."""
        response = self._call(self._stub.ListSequences, pb.ListSequencesRequest(),
                              "ListSequences")
        return [SequenceState.from_proto(s) for s in response.sequences]

    # -- steps ----------------------------------------------------------------------------

    def step(self, reports: Iterable[ReportLike], *, rank: int = 0,
             batch_id: int = 0) -> List[Decision]:
        """One batch of explicitly numbered steps (:class:`Report` or StepReport messages) in
        one unary call; returns a Decision per report, in order. Per-sequence failures are
        in the decisions; KvCacheError only for a failed call."""
        batch = pb.StepBatch(rank=rank, batch_id=batch_id, reports=reports_to_proto(reports))
        response = self._call(self._stub.Step, batch, "Step")
        return [Decision.from_proto(d) for d in response.decisions]

    def batch(self, *, rank: int = 0, head_count: Optional[int] = None,
              timeout: Optional[float] = None,
              score_region_bytes: Optional[int] = None,
              daemon_score_region: bool = False, max_inflight: int = 1,
              score_region_rank: Optional[int] = None) -> SequenceBatch:
        """A :class:`SequenceBatch` for this worker rank (its own StepStream).

        ``score_region_bytes``: send the scores through a shared-memory region of that size
        (the daemon on this node, run with --allow_shm_scores), see :meth:`stream`.
        ``max_inflight``: steps in flight at once (``SequenceBatch.submit_step``), at most
        the daemon's --max_inflight_batches. ``score_region_rank``: see :meth:`stream`."""
        return SequenceBatch(self, rank=rank, head_count=head_count, timeout=timeout,
                             score_region_bytes=score_region_bytes,
                             daemon_score_region=daemon_score_region,
                             max_inflight=max_inflight, score_region_rank=score_region_rank)

    def stream(self, *, rank: int = 0, timeout: Optional[float] = None,
               score_region_bytes: Optional[int] = None,
               daemon_score_region: bool = False, max_inflight: int = 1,
               score_region_rank: Optional[int] = None) -> StepStream:
        """A raw :class:`StepStream` for this rank: explicit step numbers, no tracking.

        ``score_region_bytes``: create and register a :class:`ScoreRegion` of that many
        bytes; every batch's scores are then written there (each report's range 64-byte
        aligned; those that do not fit go inline) and the reports name their ranges. The
        stream owns it: closing the stream unregisters and unlinks it. Raises
        KvCacheError FAILED_PRECONDITION when the daemon was started without
        --allow_shm_scores. ``daemon_score_region``: the daemon creates the region
        (CreateScoreRegion) instead of this process; the same otherwise, and a daemon
        deciding on a GPU makes it device memory, which the region maps by CUDA IPC (torch
        tensors' scores are then copied on the GPU: docs/PYTHON.md, "Device score
        regions"). ``max_inflight``:
        batches in flight at once (``StepStream.submit``), each writing its own
        1/max_inflight of the region; at most the daemon's --max_inflight_batches.
        ``score_region_rank`` (with ``daemon_score_region``): a GPU engine places the region
        on that tensor-parallel rank's GPU instead of its own (usually this stream's
        ``rank``, for a rank that writes its partial sums on its own GPU without peer
        access; docs/GPU.md); a host daemon ignores it. ValueError without
        ``daemon_score_region``."""
        check_max_inflight(max_inflight)  # before a region is made for nothing
        if score_region_rank is not None and not (score_region_bytes and daemon_score_region):
            raise ValueError("score_region_rank places a region the daemon creates: it needs "
                             "score_region_bytes and daemon_score_region=True")
        region = (ScoreRegion(self, score_region_bytes, from_daemon=daemon_score_region,
                              rank=score_region_rank)
                  if score_region_bytes else None)
        try:
            return StepStream(self._stub, rank=rank, timeout=timeout, score_region=region,
                              max_inflight=max_inflight)
        except BaseException:
            if region is not None:
                region.close()
            raise

    # -- score regions ----------------------------------------------------------------------

    def register_score_region(self, name: str, byte_size: int) -> int:
        """RegisterScoreRegion: lets the daemon map ``byte_size`` bytes of the POSIX
        shared-memory object ``name`` ("/..."); returns the region id for ScoreRefs.
        (:meth:`batch` and :meth:`stream` do this for you with ``score_region_bytes``.)
        Raises KvCacheError: FAILED_PRECONDITION (no --allow_shm_scores), INVALID_ARGUMENT
        (cannot open it, or smaller than byte_size), RESOURCE_EXHAUSTED (region limit)."""
        response = self._call(
            self._stub.RegisterScoreRegion,
            pb.RegisterScoreRegionRequest(name=name, byte_size=byte_size),
            f"RegisterScoreRegion({name!r}, {byte_size} bytes)")
        return response.region

    def create_score_region(self, byte_size: int, *,
                            rank: Optional[int] = None) -> CreatedScoreRegion:
        """CreateScoreRegion: the daemon allocates ``byte_size`` bytes where its engine
        decides (its own shared memory, or device memory on its GPU with
        --engine_backend=cuda) and says how to map them. ``rank``: on a GPU engine, place
        it on that tensor-parallel rank's GPU instead (its partial sums are then joined
        across the GPUs with NCCL). Free it with :meth:`unregister_score_region`. Raises
        KvCacheError FAILED_PRECONDITION (no --allow_shm_scores), INVALID_ARGUMENT (size,
        rank), RESOURCE_EXHAUSTED (its limits)."""
        request = pb.CreateScoreRegionRequest(byte_size=byte_size)
        if rank is not None:
            request.rank = rank
        response = self._call(self._stub.CreateScoreRegion, request,
                              f"CreateScoreRegion({byte_size} bytes)")
        return CreatedScoreRegion.from_proto(response)

    def unregister_score_region(self, region: int) -> None:
        """UnregisterScoreRegion: the daemon unmaps it (a created one: frees it). Raises
        KvCacheError NOT_FOUND."""
        self._call(self._stub.UnregisterScoreRegion,
                   pb.UnregisterScoreRegionRequest(region=region),
                   f"UnregisterScoreRegion({region})")

    # -- connection -----------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> None:
        """Waits until the channel connects; raises KvCacheError UNAVAILABLE otherwise."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise KvCacheError(grpc.StatusCode.UNAVAILABLE,
                               f"kvcached at {self.address} not reachable within {timeout} s") \
                from None

    def _call(self, method: Any, request: Any, what: str, *,
              timeout: Optional[float] = None) -> Any:
        try:
            return method(request, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as error:
            raise KvCacheError.from_rpc_error(error, what) from None

    def close(self) -> None:
        """Closes the channel (and with it every stream of this client)."""
        self._channel.close()

    def __enter__(self) -> "KvCacheClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
