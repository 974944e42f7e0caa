"""An in-process stand-in for kvcached, to test the client's own logic without the daemon.

It follows the API's shape, not SPEC.md's arithmetic: a step in order is accepted, evicts
nothing, grows the cache by one, and needs scores on every other step. It records every
StepBatch it receives, and can be told to go silent, to answer with a wrong batch id, or to
end the stream.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Dict, List

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
        self._lock = threading.Lock()

    def OpenSequence(self, request, context):
        with self._lock:
            if request.sequence_id in self.states:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"sequence '{request.sequence_id}' is already open")
            state = pb.SequenceState(
                sequence_id=request.sequence_id, prefill_len=request.prefill_len,
                budget=request.budget_tokens or 1, tp_world_size=request.tp_world_size or 1,
                score_dtype=request.score_dtype or pb.SCORE_DTYPE_FLOAT32,
                cache_size=request.prefill_len, next_needs_scores=True)
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
                if state is None:
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
