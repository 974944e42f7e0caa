"""Step reports with explicit step numbers, and one rank's StepStream.

Most workers want :class:`~kvcache_client.batch.SequenceBatch`, which numbers the steps and
tracks what each sequence needs; this layer sends exactly what it is given.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Union

import grpc

from ._proto import dtype_to_proto, pb, pb_grpc
from .errors import KvCacheError
from .results import Decision
from .scores import ScoresLike, encode_scores, normalize_dtype


@dataclass
class Report:
    """One sequence's report for one decode step, from one rank.

    ``scores``: anything :func:`~kvcache_client.scores.encode_scores` takes, or None on a step
    that needs none. ``head_count``: query heads summed into each row (tensor parallelism);
    0 when rows are already mean-pooled over all heads (single-rank sequences only).
    """

    sequence_id: str
    step: int
    scores: ScoresLike = None
    layers: Optional[int] = None
    dtype: Optional[str] = None
    head_count: int = 0

    def to_proto(self, *, default_dtype: Optional[str] = None,
                 tokens: Optional[int] = None) -> pb.StepReport:
        """Encodes the report. ``default_dtype``: the sequence's score dtype, if known (raw
        bytes without one go as UNSPECIFIED); ``tokens``: the scores per layer to check.
        Raises ScoreShapeError/TypeError like encode_scores."""
        message = pb.StepReport(sequence_id=self.sequence_id, step=self.step,
                                head_count=self.head_count)
        encoded = encode_scores(self.scores, dtype=self.dtype, layers=self.layers,
                                tokens=tokens,
                                default_dtype=normalize_dtype(default_dtype))
        if encoded is not None:
            message.scores = encoded.data
            message.layers = encoded.layers
            message.dtype = dtype_to_proto(encoded.dtype)
        return message


ReportLike = Union[Report, pb.StepReport]


def reports_to_proto(reports: Iterable[ReportLike]) -> List[pb.StepReport]:
    """Report objects encoded; StepReport messages pass as they are (an escape hatch)."""
    return [r if isinstance(r, pb.StepReport) else r.to_proto() for r in reports]


_CLOSE = object()
_END = object()


class StepStream:
    """One StepStream call: a worker rank's path for its decode steps.

    ``send(reports)`` writes one StepBatch and waits for its DecisionBatch. A bad report fails
    only its own Decision; the stream itself fails only when the connection does, after
    which every ``send`` raises the KvCacheError that ended it.

    Thread-safety: ``send`` calls are serialized by a lock; use one stream per rank (and,
    for tensor parallelism, one thread per rank: a rank's batch is answered only once every
    rank has reported its steps).
    """

    def __init__(self, stub: pb_grpc.KvCacheStub, *, rank: int = 0,
                 timeout: Optional[float] = None, metadata=None) -> None:
        """``timeout``: seconds to wait for each reply (None: forever). A reply that misses
        it fails the stream with DEADLINE_EXCEEDED, since its steps may still be decided."""
        self.rank = rank
        self.timeout = timeout
        self._requests: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._replies: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._batch_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._failure: Optional[KvCacheError] = None
        self._closed = False
        self._call = stub.StepStream(self._outgoing(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name=f"kvcache-stream-rank{rank}",
                                        daemon=True)
        self._reader.start()

    def _outgoing(self) -> Iterator[pb.StepBatch]:
        while True:
            item = self._requests.get()
            if item is _CLOSE:
                return
            yield item

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            self._replies.put(_END)
        except grpc.RpcError as error:
            self._replies.put(error)

    @property
    def failed(self) -> Optional[KvCacheError]:
        """The error that ended the stream, or None while it works."""
        return self._failure

    def send(self, reports: Iterable[ReportLike]) -> List[Decision]:
        """Sends one batch; returns its decisions, one per report, in order."""
        messages = reports_to_proto(reports)
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise KvCacheError(grpc.StatusCode.CANCELLED, "the step stream is closed")
            if not messages:
                return []
            batch_id = next(self._batch_ids)
            self._requests.put(pb.StepBatch(rank=self.rank, batch_id=batch_id,
                                            reports=messages))
            reply = self._wait_reply(batch_id)
            if len(reply.decisions) != len(messages):
                raise self._fail(grpc.StatusCode.INTERNAL,
                                 f"batch {batch_id} of {len(messages)} reports got "
                                 f"{len(reply.decisions)} decisions")
            return [Decision.from_proto(d) for d in reply.decisions]

    def _wait_reply(self, batch_id: int) -> pb.DecisionBatch:
        try:
            reply = self._replies.get(timeout=self.timeout)
        except queue.Empty:
            self._call.cancel()
            raise self._fail(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no reply to batch {batch_id} within {self.timeout} s "
                             "(for tensor parallelism: has every rank sent its step?)") from None
        if isinstance(reply, grpc.RpcError):
            self._failure = KvCacheError.from_rpc_error(reply, f"StepStream (rank {self.rank})")
            raise self._failure
        if reply is _END:
            raise self._fail(grpc.StatusCode.UNAVAILABLE,
                             f"the daemon ended the step stream before answering batch "
                             f"{batch_id}")
        if reply.batch_id != batch_id:
            raise self._fail(grpc.StatusCode.INTERNAL,
                             f"reply for batch {reply.batch_id} while batch {batch_id} waited")
        return reply

    def _fail(self, code: grpc.StatusCode, message: str) -> KvCacheError:
        self._failure = KvCacheError(code, f"StepStream (rank {self.rank}): {message}")
        return self._failure

    def close(self, timeout: float = 1.0) -> None:
        """Ends the stream (half-close, then cancel if the daemon does not finish it)."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(_CLOSE)
        self._reader.join(timeout)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(timeout)

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
