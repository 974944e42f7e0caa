"""Step reports with explicit step numbers, and one rank's StepStream.

Most workers want :class:`~kvcache_client.batch.SequenceBatch`, which numbers the steps and
tracks what each sequence needs; this layer sends exactly what it is given.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, List, Optional, Union

import grpc

from ._proto import dtype_to_proto, pb, pb_grpc
from .errors import KvCacheError
from .results import Decision
from .scores import PreparedScores, ScoresLike, normalize_dtype, prepare_scores

if TYPE_CHECKING:
    from .region import ScoreRegion

__all__ = ["Report", "ReportLike", "StepStream"]


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

    def prepare(self, *, default_dtype: Optional[str] = None,
                tokens: Optional[int] = None) -> Optional[PreparedScores]:
        """The scores checked and sized, not packed yet (None: no scores). Arguments as
        :meth:`to_proto`."""
        return prepare_scores(self.scores, dtype=self.dtype, layers=self.layers,
                              tokens=tokens, default_dtype=normalize_dtype(default_dtype))

    def to_proto(self, *, default_dtype: Optional[str] = None, tokens: Optional[int] = None,
                 region: Optional["ScoreRegion"] = None) -> pb.StepReport:
        """Encodes the report. ``default_dtype``: the sequence's score dtype, if known (raw
        bytes without one go as UNSPECIFIED); ``tokens``: the scores per layer to check;
        ``region``: write the scores there and send a ScoreRef (inline when they do not
        fit). Raises ScoreShapeError/TypeError like encode_scores."""
        prepared = self.prepare(default_dtype=default_dtype, tokens=tokens)
        return report_message(self.sequence_id, self.step, self.head_count, prepared, region)


def report_message(sequence_id: str, step: int, head_count: int,
                   prepared: Optional[PreparedScores],
                   region: Optional["ScoreRegion"] = None) -> pb.StepReport:
    """A StepReport carrying ``prepared`` inline, or by reference into ``region`` when it
    fits there."""
    message = pb.StepReport(sequence_id=sequence_id, step=step, head_count=head_count)
    if prepared is None:
        return message
    message.layers = prepared.layers
    message.dtype = dtype_to_proto(prepared.dtype)
    offset = region.place(prepared) if region is not None else None
    if offset is None:
        message.scores = prepared.to_bytes()
    else:
        message.score_ref.region = region.region_id  # type: ignore[union-attr]
        message.score_ref.offset = offset
        message.score_ref.byte_size = prepared.nbytes
    return message


ReportLike = Union[Report, pb.StepReport]


def reports_to_proto(reports: Iterable[ReportLike],
                     region: Optional["ScoreRegion"] = None) -> List[pb.StepReport]:
    """Report objects encoded (their scores into ``region`` when given and they fit);
    StepReport messages pass as they are (an escape hatch)."""
    return [r if isinstance(r, pb.StepReport) else r.to_proto(region=region)
            for r in reports]


_CLOSE = object()
_END = object()


class StepStream:
    """One StepStream call: a worker rank's path for its decode steps.

    ``send(reports)`` writes one StepBatch and waits for its DecisionBatch. A bad report fails
    only its own Decision; the stream itself fails only when the connection does, after
    which every ``send`` raises the KvCacheError that ended it.

    With a :class:`~kvcache_client.region.ScoreRegion` (``client.stream(
    score_region_bytes=N)``) the scores of :class:`Report` objects go through the region
    (each batch from its start: a batch is sent only after the previous one's decisions
    arrived); the stream owns it and closes it in :meth:`close`.

    Thread-safety: ``send`` calls are serialized by a lock; use one stream per rank (and,
    for tensor parallelism, one thread per rank: a rank's batch is answered only once every
    rank has reported its steps).
    """

    def __init__(self, stub: pb_grpc.KvCacheStub, *, rank: int = 0,
                 timeout: Optional[float] = None, metadata=None,
                 score_region: Optional["ScoreRegion"] = None) -> None:
        """``timeout``: seconds to wait for each reply (None: forever). A reply that misses
        it fails the stream with DEADLINE_EXCEEDED, since its steps may still be decided.
        ``score_region``: a registered region the stream then owns (closes with itself)."""
        self.rank = rank
        self.timeout = timeout
        self.score_region = score_region
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
        reports = list(reports)
        return self.send_built(lambda region: reports_to_proto(reports, region))

    def send_built(self, build: Callable[[Optional["ScoreRegion"]], List[pb.StepReport]]
                   ) -> List[Decision]:
        """Sends the batch ``build(region)`` returns, built under the stream's lock once
        the region (None without one) is free to be written from its start."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise KvCacheError(grpc.StatusCode.CANCELLED, "the step stream is closed")
            region = self.score_region
            if region is not None:
                region.begin_batch()  # the previous batch's decisions have all arrived
            messages = build(region)
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
        """Ends the stream (half-close, then cancel if the daemon does not finish it), then
        unregisters and unlinks its score region, if any."""
        if self._closed:
            return
        self._closed = True
        try:
            self._requests.put(_CLOSE)
            self._reader.join(timeout)
            if self._reader.is_alive():
                self._call.cancel()
                self._reader.join(timeout)
        finally:
            if self.score_region is not None:
                # A send still waiting (another thread) ends with the stream: let it.
                locked = self._lock.acquire(timeout=timeout)
                try:
                    self.score_region.close()
                finally:
                    if locked:
                        self._lock.release()

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
