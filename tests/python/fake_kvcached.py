"""An in-process stand-in for kvcached, to test the client's own logic without the daemon.

It follows the API's shape, not SPEC.md's arithmetic: a step in order is accepted, evicts
nothing, grows the cache by one, and needs scores on every other step. It records every
StepBatch it receives, and can be told to go silent, to answer with a wrong batch id, or to
end the stream.

Score regions: it maps registered shared-memory objects read-only (unless told
``allow_shm = False``, as kvcached without --allow_shm_scores) and resolves every report's
scores, inline or by ScoreRef, into ``resolved`` at the time it decides, as the daemon does.
Folded sequences get fold weights from the policy's fields (presets are not resolved).
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent import futures
from typing import Dict, List, NamedTuple, Optional, Tuple

import _posixshmem
import grpc

from kvcache.v1 import kvcache_pb2 as pb
from kvcache.v1 import kvcache_pb2_grpc as pb_grpc


class FakeKvCache(pb_grpc.KvCacheServicer):
    def __init__(self) -> None:
        self.states: Dict[str, pb.SequenceState] = {}
        self.batches: List[pb.StepBatch] = []
        self.silent = threading.Event()       # receive, never answer
        self.wrong_batch_id = False
        self.end_stream = False
        self.allow_shm = True
        self.regions: Dict[int, Tuple[str, int, mmap.mmap]] = {}
        self.registered: List[Tuple[int, str, int]] = []  # (id, name, byte_size)
        self.unregistered: List[int] = []
        self.resolved: List[Resolved] = []
        self._next_region = 41
        self._lock = threading.Lock()

    def RegisterScoreRegion(self, request, context):
        if not self.allow_shm:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "shared-memory score regions are off (start kvcached with "
                          "--allow_shm_scores)")
        try:
            fd = _posixshmem.shm_open(request.name, os.O_RDONLY, mode=0)
        except OSError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"score region '{request.name}': {error.strerror}")
        try:
            size = os.fstat(fd).st_size
            if size < request.byte_size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"score region '{request.name}' has {size} bytes, "
                              f"byte_size is {request.byte_size}")
            mapping = mmap.mmap(fd, request.byte_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with self._lock:
            self._next_region += 1
            region = self._next_region
            self.regions[region] = (request.name, request.byte_size, mapping)
            self.registered.append((region, request.name, request.byte_size))
        return pb.RegisterScoreRegionResponse(region=region)

    def UnregisterScoreRegion(self, request, context):
        with self._lock:
            entry = self.regions.pop(request.region, None)
            if entry is None:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"score region {request.region} is not registered")
            entry[2].close()
            self.unregistered.append(request.region)
        return pb.UnregisterScoreRegionResponse()

    def OpenSequence(self, request, context):
        with self._lock:
            if request.sequence_id in self.states:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"sequence '{request.sequence_id}' is already open")
            state = pb.SequenceState(
                sequence_id=request.sequence_id, prefill_len=request.prefill_len,
                budget=request.budget_tokens or 1, tp_world_size=request.tp_world_size or 1,
                score_dtype=request.score_dtype or pb.SCORE_DTYPE_FLOAT32,
                cache_size=request.prefill_len, next_needs_scores=True,
                score_layout=request.score_layout or pb.SCORE_LAYOUT_PER_LAYER,
                layers=request.layers)
            if request.score_layout == pb.SCORE_LAYOUT_FOLDED:
                weights = fold_weights(request.policy, request.layers)
                if weights is not None:
                    state.fold_weights.CopyFrom(weights)
            self.states[request.sequence_id] = state
            return pb.OpenSequenceResponse(state=state)

    def InspectSequence(self, request, context):
        with self._lock:
            if request.sequence_id not in self.states:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"sequence '{request.sequence_id}' is not open")
            return pb.InspectSequenceResponse(state=self.states[request.sequence_id])

    def Step(self, request, context):
        return self._decide(request)

    def StepStream(self, request_iterator, context):
        for batch in request_iterator:
            if self.end_stream:
                return
            reply = self._decide(batch)
            if self.silent.is_set():
                continue
            if self.wrong_batch_id:
                reply.batch_id += 1000
            yield reply

    def _decide(self, batch: pb.StepBatch) -> pb.DecisionBatch:
        with self._lock:
            self.batches.append(batch)
            reply = pb.DecisionBatch(batch_id=batch.batch_id)
            for report in batch.reports:
                decision = reply.decisions.add(sequence_id=report.sequence_id, step=report.step)
                state = self.states.get(report.sequence_id)
                problem = self._resolve(report)
                if problem:
                    decision.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                    decision.message = (f"sequence '{report.sequence_id}' step {report.step}: "
                                        f"{problem}")
                elif state is None:
                    decision.code = grpc.StatusCode.NOT_FOUND.value[0]
                    decision.message = f"sequence '{report.sequence_id}' is not open"
                elif report.step != state.last_step + 1:
                    decision.code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
                    decision.message = f"step {report.step} is out of order"
                else:
                    state.last_step = report.step
                    state.cache_size += 1
                    state.next_needs_scores = report.step % 2 == 0
                    decision.cache_size = state.cache_size
                    decision.next_needs_scores = state.next_needs_scores
            return reply


    def _resolve(self, report: pb.StepReport) -> Optional[str]:
        """Records the report's score bytes; returns what is wrong with its ScoreRef."""
        if report.WhichOneof("score_source") != "score_ref":
            self.resolved.append(Resolved(report.sequence_id, report.step, report.scores,
                                          None, report.layers, report.dtype))
            return None
        ref = report.score_ref
        entry = self.regions.get(ref.region)
        if entry is None:
            return (f"score region {ref.region} is not registered (offset {ref.offset}, "
                    f"byte_size {ref.byte_size})")
        _, size, mapping = entry
        if ref.offset + ref.byte_size > size:
            return (f"score region {ref.region} holds {size} bytes; offset {ref.offset} + "
                    f"byte_size {ref.byte_size} is past its end")
        self.resolved.append(Resolved(report.sequence_id, report.step,
                                      mapping[ref.offset:ref.offset + ref.byte_size], ref,
                                      report.layers, report.dtype))
        return None


class Resolved(NamedTuple):
    """One report's scores as the fake read them when it decided."""

    sequence_id: str
    step: int
    data: bytes
    ref: Optional[pb.ScoreRef]  # None: inline
    layers: int
    dtype: int


def fold_weights(policy: pb.Policy, layers: int) -> Optional[pb.FoldWeights]:
    """SPEC.md's fold weights for a policy given by its fields (K = layers)."""
    k = layers
    if policy.preset or k < 1:
        return None
    if policy.aggregation in (pb.AGGREGATION_UNSPECIFIED, pb.AGGREGATION_EMA):
        a = policy.alpha if policy.HasField("alpha") else 0.8
        return pb.FoldWeights(layer_weights=[(1 - a) * a ** (k - 1 - l) for l in range(k)],
                              decay=a ** k)
    if policy.aggregation == pb.AGGREGATION_CUMULATIVE:
        return pb.FoldWeights(layer_weights=[1.0] * k, decay=1.0)
    if policy.aggregation == pb.AGGREGATION_SINGLE_STEP:
        return pb.FoldWeights(layer_weights=[1.0 / k] * k, decay=0.0)
    return None


class FakeServer:
    """Serves a FakeKvCache on an ephemeral loopback port."""

    def __init__(self) -> None:
        self.service = FakeKvCache()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_KvCacheServicer_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)
