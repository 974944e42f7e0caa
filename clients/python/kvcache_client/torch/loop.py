"""The decode loop: steps a batch's sequences with their KV caches, capturing scores only
on the steps that need them; and micro-batches alternating, each computed while the
other's step is in flight to the daemon.

Not thread-safe: a loop belongs to one worker thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Set

from ..errors import SequenceInFlightError, StepError
from .caches import KvCache
from .capture import SCORERS, ObservationWindow, StepScores

__all__ = ["DecodeLoop", "MicroBatchTurn", "MicroBatchedDecode", "PendingStep"]


@dataclass
class PendingStep:
    """A step :meth:`DecodeLoop.submit` sent whose decisions are not applied yet: give it
    to that loop's :meth:`~DecodeLoop.complete`. ``future`` is the batch's
    :class:`~kvcache_client.StepFuture` (``done()`` says whether the decisions arrived)."""

    future: Any
    captures: Mapping[str, Optional[StepScores]]
    sequence_ids: FrozenSet[str]
    send_s: float                 #: spent in submit: packing, writing, waiting for a slot
    loop: "DecodeLoop" = field(repr=False)
    completed: bool = False


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
    decisions: the daemon round trip), ``wait_s`` (the part of ``step_s`` the worker was
    blocked on the daemon: all of it in ``finish``, the wait inside ``complete``),
    ``apply_s`` (applying them to the caches).

    Without waiting (a batch with ``max_inflight`` > 1): ``pending = loop.submit(captures)``
    sends the step and returns at once; ``loop.complete(pending)`` waits for its decisions
    and applies them, as ``finish`` does (which is the two back to back). Between the two
    the step's sequences are in flight: their caches must not be touched, and ``begin``
    refuses them (SequenceInFlightError). :class:`MicroBatchedDecode` alternates loops so.

    ``observation_window=w`` (default 0, off): step 1 pools the attention of the prompt's
    last ``w`` queries with the first decode query's (:class:`ObservationWindow`). ``add``
    gives a sequence that has not stepped yet an empty window; the model's prefill fills
    it (``loop.window(id).add(q, keys)`` per layer); step 1's capture reads it, and it is
    dropped once step 1 is decided.
    """

    def __init__(self, batch: Any, *, scorer: str = "attention",
                 dtype: Optional[str] = None, observation_window: int = 0) -> None:
        """``scorer``: see :data:`SCORERS`. ``dtype``: wire dtype of the scores (default:
        each sequence's ``score_dtype``). ``observation_window``: see the class."""
        if scorer not in SCORERS:
            raise ValueError(f"unknown scorer {scorer!r}; use one of {SCORERS}")
        if isinstance(observation_window, bool) or not isinstance(observation_window, int) \
                or observation_window < 0:
            raise ValueError(f"observation_window must be an integer >= 0, got "
                             f"{observation_window!r}")
        self.batch = batch
        self.scorer = scorer
        self.dtype = dtype
        self.observation_window = observation_window
        self.caches: Dict[str, KvCache] = {}
        self.windows: Dict[str, ObservationWindow] = {}
        self.stats: Dict[str, float] = {"steps": 0, "scoring_steps": 0, "capture_s": 0.0,
                                        "step_s": 0.0, "wait_s": 0.0, "apply_s": 0.0}
        # Sequence ids of the steps submitted and not completed.
        self._in_flight: Set[str] = set()

    def add(self, sequence_id: str, cache: KvCache, *,
            window: Optional[ObservationWindow] = None) -> None:
        """Steps ``sequence_id`` (tracked by the batch) with ``cache`` from now on.
        ``window``: the sequence's observation window, filled already (else, with
        ``observation_window`` set and step 1 ahead, an empty one to fill)."""
        if sequence_id not in self.batch:
            raise KeyError(f"sequence {sequence_id!r} is not in the batch; open() it first")
        first = self.batch.sequences[sequence_id].next_step == 1
        if window is not None and not first:
            raise ValueError(f"sequence {sequence_id!r} is past step 1: an observation "
                             "window only pools step 1")
        if window is None and first and self.observation_window:
            window = ObservationWindow(self.observation_window)
        self.caches[sequence_id] = cache
        if window is not None:
            self.windows[sequence_id] = window

    def window(self, sequence_id: str) -> Optional[ObservationWindow]:
        """The observation window step 1 of ``sequence_id`` will pool (None: none)."""
        return self.windows.get(sequence_id)

    def remove(self, sequence_id: str) -> None:
        """Stops stepping ``sequence_id`` here; a step of it in flight is then completed
        without applying its decision (there is no cache to apply it to)."""
        self.caches.pop(sequence_id, None)
        self.windows.pop(sequence_id, None)

    def begin(self) -> Dict[str, Optional[StepScores]]:
        """The captures of the next step: a :class:`StepScores` for each sequence whose
        step needs scores, None for the others. SequenceInFlightError while a sequence is
        in a step submitted and not completed (whether it needs scores is not known yet)."""
        captures: Dict[str, Optional[StepScores]] = {}
        for sequence_id in self.caches:
            if sequence_id in self._in_flight:
                raise SequenceInFlightError(
                    f"sequence {sequence_id!r} is in a step this loop submitted and has "
                    "not completed: complete() it first (its next step depends on that "
                    "decision, and its cache must not change meanwhile)")
            tracked = self.batch.sequences[sequence_id]
            if not tracked.next_needs_scores:
                captures[sequence_id] = None
                continue
            captures[sequence_id] = StepScores(
                scorer=self.scorer, head_sum=bool(tracked.head_count),
                fold_weights=tracked.fold_weights if tracked.folded else None,
                window=self.windows.get(sequence_id) if tracked.next_step == 1 else None)
        return captures

    def finish(self, captures: Mapping[str, Optional[StepScores]]) -> Dict[str, Any]:
        """Sends the step of every sequence in ``captures`` and applies the decisions to
        their caches; returns the decisions. Raises StepError when the daemon rejects one,
        after applying the accepted ones (:meth:`_decided`)."""
        reports = self._reports(captures)
        return self._decided(
            captures, lambda: self.batch.step(reports, dtype=self.dtype, raise_on_error=True),
            sent_s=0.0)

    def submit(self, captures: Mapping[str, Optional[StepScores]]) -> PendingStep:
        """Sends the step of every sequence in ``captures`` without waiting for the
        decisions (``SequenceBatch.submit_step``; blocks only while the batch has
        ``max_inflight`` steps unanswered). The scores are packed before it returns, so
        the captures' tensors may be reused; the caches may not, until :meth:`complete`.
        Raises what ``submit_step`` raises before sending (SequenceInFlightError, KeyError)."""
        reports = self._reports(captures)
        built = time.perf_counter()
        future = self.batch.submit_step(reports, dtype=self.dtype, raise_on_error=True)
        sequence_ids = frozenset(captures)
        self._in_flight |= sequence_ids
        return PendingStep(future, captures, sequence_ids, time.perf_counter() - built, self)

    def complete(self, pending: PendingStep) -> Dict[str, Any]:
        """Waits for the decisions of a step :meth:`submit` sent, applies them to the
        caches, drops the spent observation windows and returns the decisions, as
        :meth:`finish`. Raises StepError when the daemon rejected one (the accepted ones
        applied, as :meth:`finish` does), and the stream's KvCacheError when it failed (no
        decision arrived: nothing applied); the step is over either way."""
        if pending.loop is not self:
            raise ValueError("this step was submitted by another DecodeLoop")
        if pending.completed:
            raise ValueError("this step was completed already")

        def wait() -> Dict[str, Any]:
            try:
                return pending.future.result()
            finally:
                pending.completed = True
                self._in_flight -= pending.sequence_ids

        return self._decided(pending.captures, wait, sent_s=pending.send_s)

    def _decided(self, captures: Mapping[str, Optional[StepScores]],
                 wait: Callable[[], Dict[str, Any]], *, sent_s: float) -> Dict[str, Any]:
        """``wait()``'s decisions applied to the caches; ``sent_s``: time the step spent
        being sent before ``wait``. A step the daemon rejected for some sequences decided
        the others: they moved on (the batch tracks their next step), so their decisions
        are applied before the StepError goes up, or their caches would lag the daemon's
        for good. A rejected sequence's cache and observation window stay as they were:
        redo its step."""
        started = time.perf_counter()
        try:
            decisions = wait()
        except StepError as error:
            accepted = {sid: d for sid, d in (error.decisions or {}).items() if d.ok}
            if accepted:
                waited = time.perf_counter() - started
                self._apply({sid: captures.get(sid) for sid in accepted}, accepted,
                            step_s=sent_s + waited, wait_s=waited)
            raise
        waited = time.perf_counter() - started
        return self._apply(captures, decisions, step_s=sent_s + waited, wait_s=waited)

    @staticmethod
    def _reports(captures: Mapping[str, Optional[StepScores]]) -> Dict[str, Any]:
        return {sid: (None if c is None else c.report()) for sid, c in captures.items()}

    def _apply(self, captures: Mapping[str, Optional[StepScores]],
               decisions: Dict[str, Any], *, step_s: float, wait_s: float) -> Dict[str, Any]:
        """Applies a step's accepted decisions to the caches; adds the step to ``stats``."""
        started = time.perf_counter()
        for sequence_id, decision in decisions.items():
            cache = self.caches.get(sequence_id)
            if cache is not None:  # None: removed while its step was in flight
                cache.apply(decision)
            self.windows.pop(sequence_id, None)  # step 1 is decided: the window is spent
        done = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["scoring_steps"] += any(c is not None for c in captures.values())
        self.stats["capture_s"] += sum(c.seconds for c in captures.values() if c is not None)
        self.stats["step_s"] += step_s
        self.stats["wait_s"] += wait_s
        self.stats["apply_s"] += done - started
        return decisions


class MicroBatchTurn(NamedTuple):
    """One micro-batch's turn of :class:`MicroBatchedDecode`."""

    index: int                                   #: which loop (0, 1, ...)
    loop: DecodeLoop                             #: its caches are the model's to extend
    captures: Dict[str, Optional[StepScores]]    #: as ``DecodeLoop.begin``
    decisions: Optional[Dict[str, Any]]          #: its previous step's, applied (None: first)


class MicroBatchedDecode:
    """Micro-batches that alternate, each computed while the others' steps are in flight
    to the daemon: the model is never idle waiting for a round trip while another
    micro-batch has work.

        batch = client.batch(max_inflight=2)         # daemon: --max_inflight_batches >= 2
        halves = [DecodeLoop(batch), DecodeLoop(batch)]
        for i, (sid, cache) in enumerate(sequences):
            halves[i % 2].add(sid, cache)            # each sequence in one micro-batch
        decode = MicroBatchedDecode(halves)
        while generating:
            turn = decode.begin()                    # A, then B, then A, ...
            model.decode(turn.loop.caches, turn.captures)
            decode.submit(turn.captures)             # sent; the next turn computes meanwhile
        decode.drain()                               # the steps still in flight, applied

    Invariant: a micro-batch's caches change only in its own turn. ``begin`` of loop ``i``
    first completes loop ``i``'s step in flight (waits for its decisions and applies them,
    :meth:`DecodeLoop.complete`), so the model extends caches that hold exactly what the
    daemon kept; ``submit`` sends the step and moves the turn on without waiting. While
    loop ``i``'s step travels, only the other loops' caches are computed on. Each
    micro-batch therefore steps, and decides, exactly as it would with
    ``begin``/``finish`` alone; the micro-batches only overlap in time.

    The loops may share one batch (its ``max_inflight`` at least the number of loops that
    share it, so that their steps are in flight together) or have one each; a sequence
    belongs to one loop. ``stats``: ``turns`` (steps submitted), ``wait_s`` (time blocked
    in ``begin``/``drain`` on the daemon's decisions), ``total_s`` (from the first
    ``begin`` to the end of the latest call): ``wait_s`` well under ``total_s`` is the
    round trip hidden behind the model. A StepError from ``begin`` (a rejected step; the
    turn's accepted decisions applied) leaves that turn open with nothing in flight.
    """

    def __init__(self, loops: Sequence[DecodeLoop]) -> None:
        """``loops``: two (or more) loops, stepped in this order. ValueError when loops
        share a batch whose ``max_inflight`` cannot hold their steps together."""
        self.loops: List[DecodeLoop] = list(loops)
        if len(self.loops) < 2:
            raise ValueError(f"give at least two loops to alternate, got {len(self.loops)}")
        if len({id(loop) for loop in self.loops}) != len(self.loops):
            raise ValueError("each loop is one micro-batch: give distinct loops")
        for loop in self.loops:
            sharing = sum(other.batch is loop.batch for other in self.loops)
            limit = getattr(loop.batch, "max_inflight", 1)
            if sharing > limit:
                raise ValueError(
                    f"{sharing} loops share a batch with max_inflight={limit}: their steps "
                    f"could not be in flight together; use client.batch(max_inflight="
                    f"{sharing}) (and kvcached --max_inflight_batches >= {sharing})")
        self.stats: Dict[str, float] = {"turns": 0, "wait_s": 0.0, "total_s": 0.0}
        self._pending: List[Optional[PendingStep]] = [None] * len(self.loops)
        self._turn = 0
        self._open: Optional[int] = None     # the loop between begin and submit
        self._started: Optional[float] = None

    def begin(self) -> MicroBatchTurn:
        """The next micro-batch's turn: its previous step completed and applied, then its
        captures. Raises what :meth:`DecodeLoop.complete` raises."""
        if self._open is not None:
            raise RuntimeError(f"micro-batch {self._open}'s turn is open: submit() its "
                               "captures first")
        if self._started is None:
            self._started = time.perf_counter()
        index = self._turn
        loop = self.loops[index]
        decisions = self._complete(index)
        self._open = index
        turn = MicroBatchTurn(index, loop, loop.begin(), decisions)
        self._clock()
        return turn

    def submit(self, captures: Mapping[str, Optional[StepScores]]) -> PendingStep:
        """Sends the open turn's step (:meth:`DecodeLoop.submit`) and moves the turn to the
        next micro-batch; returns the step in flight."""
        if self._open is None:
            raise RuntimeError("no turn is open: begin() first")
        index = self._open
        self._pending[index] = self.loops[index].submit(captures)
        self._open = None
        self._turn = (index + 1) % len(self.loops)
        self.stats["turns"] += 1
        self._clock()
        return self._pending[index]  # type: ignore[return-value]

    def drain(self) -> List[Optional[Dict[str, Any]]]:
        """Completes every step still in flight, oldest first; returns each loop's
        decisions (None where none was in flight). Each micro-batch's caches then hold
        what the daemon kept, and ``begin`` may go on."""
        order = [(self._turn + k) % len(self.loops) for k in range(len(self.loops))]
        got: List[Optional[Dict[str, Any]]] = [None] * len(self.loops)
        for index in order:
            got[index] = self._complete(index)
        self._clock()
        return got

    def _complete(self, index: int) -> Optional[Dict[str, Any]]:
        pending, self._pending[index] = self._pending[index], None
        if pending is None:
            return None
        waited = self.loops[index].stats["wait_s"]
        try:
            return self.loops[index].complete(pending)
        finally:
            self.stats["wait_s"] += self.loops[index].stats["wait_s"] - waited

    def _clock(self) -> None:
        if self._started is not None:
            self.stats["total_s"] = time.perf_counter() - self._started
