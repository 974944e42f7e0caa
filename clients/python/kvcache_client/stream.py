"""Step reports with explicit step numbers, and one rank's StepStream.

Most workers want :class:`~kvcache_client.batch.SequenceBatch`, which numbers the steps and
tracks what each sequence needs; this layer sends exactly what it is given.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Deque, Iterable, Iterator, List, Optional,
                    Union)

import grpc

from ._proto import dtype_to_proto, pb, pb_grpc
from .errors import KvCacheError
from .region import ALIGNMENT
from .results import Decision
from .scores import PreparedScores, ScoresLike, normalize_dtype, prepare_scores

if TYPE_CHECKING:
    from .region import ScoreRegion

__all__ = ["Report", "ReportLike", "StepFuture", "StepStream"]


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

#: The daemon's --max_inflight_batches accepts 1 to 1024: more could never be in flight.
MAX_INFLIGHT_LIMIT = 1024


def check_max_inflight(max_inflight: object) -> None:
    """ValueError, naming the argument, unless ``max_inflight`` is an int in 1..1024."""
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) \
            or not 1 <= max_inflight <= MAX_INFLIGHT_LIMIT:
        raise ValueError(f"max_inflight must be an int from 1 to {MAX_INFLIGHT_LIMIT} (at most "
                         f"the daemon's --max_inflight_batches), got {max_inflight!r}")


class StepFuture(futures.Future):
    """The decisions of one submitted batch, to come (a ``concurrent.futures.Future``).

    ``result(timeout=None)`` returns what the blocking call returns (``StepStream.send``: the
    list of Decision; ``SequenceBatch.submit_step``: the dict by sequence id) or raises what
    it raises: the KvCacheError that ended the stream, CANCELLED when the stream was closed
    before the reply, and ``concurrent.futures.TimeoutError`` only for ``result``'s own
    ``timeout``. ``batch_id`` is the StepBatch's (None for a batch that sent nothing).

    A batch cannot be cancelled once sent (the daemon decides it anyway): ``cancel()``
    returns False. Done-callbacks run on the stream's reader thread, in batch order: keep
    them short, and never wait there for another batch of the same stream. For asyncio,
    ``await asyncio.wrap_future(future)``.
    """

    def __init__(self, transform: Optional[Callable[[List[Decision]], Any]] = None) -> None:
        super().__init__()
        self.batch_id: Optional[int] = None
        self._transform = transform
        self.set_running_or_notify_cancel()  # sent at once: no longer cancellable

    def _finish(self, decisions: List[Decision]) -> None:
        """Sets the result (or what the transform raised): once, by whoever owns it."""
        try:
            value = self._transform(decisions) if self._transform is not None else decisions
        except Exception as error:  # noqa: BLE001 - it is the caller's to see, on result()
            self.set_exception(error)
        else:
            self.set_result(value)


@dataclass
class _InFlight:
    """A sent batch whose reply has not arrived."""

    batch_id: int
    reports: int
    deadline: Optional[float]  # time.monotonic() by which its reply is due; None: never
    future: StepFuture


class StepStream:
    """One StepStream call: a worker rank's path for its decode steps.

    ``send(reports)`` writes one StepBatch and waits for its DecisionBatch; ``submit(reports)``
    writes it and returns a :class:`StepFuture` at once, so that up to ``max_inflight``
    batches are in flight together (``send`` is ``submit(...).result()``). A bad report
    fails only its own Decision; the stream itself fails only when the connection does (or
    a reply is late or does not match), after which every batch in flight fails, and every
    later ``send``/``submit`` raises, with the KvCacheError that ended it.

    Order: the daemon answers a stream's batches in the order it read them
    (server/step_stream_reactor.h), and the batches are written in the order submitted, so
    the replies are matched to the in-flight batches oldest first; a reply whose batch_id is
    not the oldest's fails the stream (INTERNAL) rather than reach another batch's future.

    Back-pressure: a ``submit`` with ``max_inflight`` batches unanswered blocks until the
    oldest is answered (or the stream fails or closes): nothing queues without a bound.

    With a :class:`~kvcache_client.region.ScoreRegion` (``client.stream(
    score_region_bytes=N)``) the scores of :class:`Report` objects go through the region:
    each of the ``max_inflight`` batches in flight writes its own 1/max_inflight of it (a
    64-byte-aligned window; what does not fit goes inline), reused only once the batch that
    last wrote it was answered. In a region in GPU memory the scores are written on the
    current stream, and each batch is sent once that stream has reached a CUDA event
    recorded after its last write (one wait per batch). The stream owns the region and
    closes it in :meth:`close`.

    Thread-safety: ``submit``/``send`` calls are serialized by a lock; use one stream per
    rank (and, for tensor parallelism, one thread per rank: a rank's batch is answered only
    once every rank has reported its steps).
    """

    def __init__(self, stub: pb_grpc.KvCacheStub, *, rank: int = 0,
                 timeout: Optional[float] = None, metadata=None,
                 score_region: Optional["ScoreRegion"] = None, max_inflight: int = 1) -> None:
        """``timeout``: seconds from sending a batch to its reply (None: forever). A reply
        that misses it fails the stream with DEADLINE_EXCEEDED, since its steps may still be
        decided. ``score_region``: a registered region the stream then owns (closes with
        itself). ``max_inflight``: batches sent and not yet answered, at most; keep it at or
        under the daemon's --max_inflight_batches (default 8), past which the daemon stops
        reading the stream and the extra batches only wait, their timeout running.
        Raises ValueError for a ``max_inflight`` outside 1..1024."""
        check_max_inflight(max_inflight)
        self.rank = rank
        self.timeout = timeout
        self.max_inflight = max_inflight
        self.score_region = score_region
        self._requests: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._sent = 0  # batches sent; the last one's batch_id
        self._submit_lock = threading.Lock()  # one batch built and written at a time
        self._state = threading.Condition()   # guards what follows; notified on each change
        self._pending: Deque[_InFlight] = collections.deque()  # oldest first
        self._failure: Optional[KvCacheError] = None
        self._closed = False
        self._call = stub.StepStream(self._outgoing(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name=f"kvcache-stream-rank{rank}",
                                        daemon=True)
        self._reader.start()
        if timeout is not None:
            threading.Thread(target=self._watch_deadlines, daemon=True,
                             name=f"kvcache-stream-rank{rank}-deadlines").start()

    def _outgoing(self) -> Iterator[pb.StepBatch]:
        while True:
            item = self._requests.get()
            if item is _CLOSE:
                return
            yield item

    @property
    def failed(self) -> Optional[KvCacheError]:
        """The error that ended the stream, or None while it works."""
        return self._failure

    @property
    def unanswered(self) -> int:
        """Batches sent whose replies have not arrived."""
        with self._state:
            return len(self._pending)

    # -- sending ----------------------------------------------------------------------------

    def send(self, reports: Iterable[ReportLike]) -> List[Decision]:
        """Sends one batch; returns its decisions, one per report, in order."""
        return self.submit(reports).result()

    def submit(self, reports: Iterable[ReportLike]) -> StepFuture:
        """Sends one batch without waiting for its reply; the future's result is what
        :meth:`send` returns. Blocks while ``max_inflight`` batches are unanswered."""
        reports = list(reports)
        return self.submit_built(lambda region: reports_to_proto(reports, region))

    def send_built(self, build: Callable[[Optional["ScoreRegion"]], List[pb.StepReport]]
                   ) -> List[Decision]:
        """:meth:`submit_built`, then its result."""
        return self.submit_built(build).result()

    def submit_built(self, build: Callable[[Optional["ScoreRegion"]], List[pb.StepReport]],
                     transform: Optional[Callable[[List[Decision]], Any]] = None
                     ) -> StepFuture:
        """Sends the batch ``build(region)`` returns, built under the stream's lock once a
        slot is free and the region (None without one) may be written from its window's
        start; returns its future. ``transform(decisions)``, when given, makes the future's
        result: it runs on the reader thread, before the future is done. Raises the
        stream's failure, or CANCELLED once closed, instead of sending."""
        future = StepFuture(transform)
        with self._submit_lock:
            self._wait_for_slot()
            region = self._region_window()
            messages = build(region)
            if region is not None:
                region.wait_for_writes()  # device memory: the GPU has written what we name
            if not messages:
                future._finish([])
                return future
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            with self._state:
                self._raise_if_over()
                self._sent += 1
                batch_id = self._sent
                self._pending.append(_InFlight(batch_id, len(messages), deadline, future))
                self._state.notify_all()  # the deadline watch may have a new oldest batch
            future.batch_id = batch_id
            self._requests.put(pb.StepBatch(rank=self.rank, batch_id=batch_id,
                                            reports=messages))
        return future

    def _wait_for_slot(self) -> None:
        """Back-pressure: waits until fewer than ``max_inflight`` batches are unanswered.
        REQUIRES: the submit lock (so that the slot stays free for this batch)."""
        with self._state:
            while True:
                self._raise_if_over()
                if len(self._pending) < self.max_inflight:
                    return
                self._state.wait()  # an answer, a failure or close() notifies

    def _raise_if_over(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise KvCacheError(grpc.StatusCode.CANCELLED, "the step stream is closed")

    def _region_window(self) -> Optional["ScoreRegion"]:
        """The region, its cursor set to this batch's window (None without a region).

        Window i of max_inflight is reused by every max_inflight-th batch sent: when a
        slot is free, at most max_inflight - 1 newer batches are unanswered, so the batch
        that last wrote the window has its decisions and the daemon is done reading it."""
        region = self.score_region
        if region is None:
            return None
        size = (region.byte_size if self.max_inflight == 1
                else region.byte_size // self.max_inflight // ALIGNMENT * ALIGNMENT)
        start = (self._sent % self.max_inflight) * size
        region.begin_batch(start, start + size)
        return region

    # -- replies ----------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            for reply in self._call:
                if not self._deliver(reply):
                    return
        except grpc.RpcError as error:
            if self._closed:
                self._fail_pending(self._closed_error())
            else:
                self._fail(KvCacheError.from_rpc_error(error, f"StepStream (rank {self.rank})"))
            return
        if self._closed:
            self._fail_pending(self._closed_error())
            return
        with self._state:
            waiting = self._pending[0].batch_id if self._pending else None
        self._fail(self._error(grpc.StatusCode.UNAVAILABLE, "the daemon ended the step stream"
                               + (f" before answering batch {waiting}" if waiting else "")))

    def _deliver(self, reply: pb.DecisionBatch) -> bool:
        """Hands the reply to the oldest batch in flight, which it must be for; otherwise
        fails the stream. Returns whether to read on."""
        with self._state:
            oldest = self._pending[0] if self._pending else None
            problem = self._mismatch(reply, oldest)
            if problem is None:
                self._pending.popleft()
                self._state.notify_all()  # a slot is free; the deadline watch moves on
        if problem is not None or oldest is None:
            self._fail(self._error(grpc.StatusCode.INTERNAL, problem or ""), cancel=True)
            return False
        oldest.future._finish([Decision.from_proto(d) for d in reply.decisions])
        return True

    @staticmethod
    def _mismatch(reply: pb.DecisionBatch, oldest: Optional[_InFlight]) -> Optional[str]:
        if oldest is None:
            return f"reply for batch {reply.batch_id} while no batch was in flight"
        if reply.batch_id != oldest.batch_id:
            return (f"reply for batch {reply.batch_id} while batch {oldest.batch_id} waited "
                    "(the daemon answers a stream's batches in order)")
        if len(reply.decisions) != oldest.reports:
            return (f"batch {oldest.batch_id} of {oldest.reports} reports got "
                    f"{len(reply.decisions)} decisions")
        return None

    def _watch_deadlines(self) -> None:
        """Fails the stream when the oldest batch in flight is past its deadline (the
        others are behind it: replies come in order)."""
        with self._state:
            while self._failure is None and not self._closed:
                oldest = self._pending[0] if self._pending else None
                left = None if oldest is None else oldest.deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._state.wait(left)
            else:
                return
        self._fail(self._error(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no reply to batch {oldest.batch_id} within {self.timeout} s (for tensor "
            "parallelism: has every rank sent its step?)"), cancel=True)

    # -- failure and close --------------------------------------------------------------------

    def _error(self, code: grpc.StatusCode, message: str) -> KvCacheError:
        return KvCacheError(code, f"StepStream (rank {self.rank}): {message}")

    def _closed_error(self) -> KvCacheError:
        return self._error(grpc.StatusCode.CANCELLED,
                           "the step stream was closed before this batch was answered")

    def _fail(self, error: KvCacheError, *, cancel: bool = False) -> KvCacheError:
        """Ends the stream with ``error`` (the first failure stays the stream's): every
        batch in flight fails with it. Returns the stream's failure."""
        with self._state:
            if self._failure is None:
                self._failure = error
            error = self._failure
        if cancel:
            self._call.cancel()
        self._fail_pending(error)
        return error

    def _fail_pending(self, error: KvCacheError) -> None:
        with self._state:
            doomed = list(self._pending)
            self._pending.clear()
            self._state.notify_all()
        for batch in doomed:  # out of the deque: no one else sets these futures
            batch.future.set_exception(error)

    def close(self, timeout: float = 1.0) -> None:
        """Ends the stream: half-closes it, so that the daemon answers the batches in flight
        (their futures get their decisions), then cancels it if the daemon has not finished
        within ``timeout`` seconds; the batches still unanswered then fail with CANCELLED.
        Then unregisters and unlinks its score region, if any."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.notify_all()  # a submit held back by max_inflight gives up
        try:
            self._requests.put(_CLOSE)
            if threading.current_thread() is not self._reader:  # not from a done-callback
                self._reader.join(timeout)
                if self._reader.is_alive():
                    self._call.cancel()
                    self._reader.join(timeout)
        finally:
            self._fail_pending(self._closed_error())
            if self.score_region is not None:
                # A submit still building (another thread) ends with the stream: let it.
                locked = self._submit_lock.acquire(timeout=timeout)
                try:
                    self.score_region.close()
                finally:
                    if locked:
                        self._submit_lock.release()

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
