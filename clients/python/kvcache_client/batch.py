"""SequenceBatch: one worker rank's running batch of sequences, stepped together.

    batch = client.batch()                      # one StepStream for this rank
    batch.open("req-1", prefill_len=812, compression_ratio=0.9)
    while generating:
        need = batch.needs_scores()             # capture attention only when needed
        decisions = batch.step({"req-1": scores if need else None})
        evict(decisions["req-1"].raise_for_status().evicted)   # or .keep_mask()
"""

from __future__ import annotations

import types
from dataclasses import dataclass
import itertools
import threading
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

import grpc

from ._proto import pb
from .errors import KvCacheError, SequenceInFlightError, StepError
from .fold import FoldWeights
from .masks import CachePositions
from .results import Decision, ImportedSequence, SequenceState, SequenceStats
from .scores import PreparedScores, ScoresLike, ScoreShapeError
from .stream import Report, StepFuture, report_message

if TYPE_CHECKING:
    from .client import KvCacheClient
    from .region import ScoreRegion

__all__ = ["SequenceBatch", "TrackedSequence"]

#: report_message's arguments but the region: (sequence_id, step, head_count, scores)
_ReportArgs = Tuple[str, int, int, Optional[PreparedScores]]


@dataclass
class TrackedSequence:
    """What a batch knows of one of its sequences (updated by every accepted step)."""

    sequence_id: str
    last_step: int
    cache_size: int
    next_needs_scores: bool
    tp_world_size: int
    head_count: int       #: query heads summed into this rank's rows; 0: mean-pooled
    score_dtype: str      #: for Python floats and raw bytes without a dtype
    score_layout: str = "per_layer"  #: or folded: one row per scoring step
    layers: int = 0                  #: folded: the K layers a folded row sums
    fold_weights: Optional[FoldWeights] = None  #: folded: for fold_scores(rows, ...)
    decision_encoding: str = "positions"  #: how its decisions travel (mask, auto)
    prefill_len: int = 0
    #: the cached positions, ascending, kept in step with the decisions: what turns a
    #: mask into positions and positions into a keep mask
    cache: Optional[CachePositions] = None

    @property
    def next_step(self) -> int:
        return self.last_step + 1

    @property
    def positions(self) -> List[int]:
        """The cached positions, ascending (a copy)."""
        return self.cache.tolist() if self.cache is not None else []

    def resolve(self, decision: Decision) -> Decision:
        """Gives an accepted decision of this sequence both forms (positions and keep mask)
        and advances the tracked cache. ValueError when it does not fit the cache."""
        if self.cache is None:
            return decision
        cache = self.cache.before(self.prefill_len + decision.step - 1)
        try:
            resolved = decision._resolve(cache)  # the batch's own, not handed out yet
        except ValueError:
            self.cache.cancel()
            raise
        self.cache.keep(resolved._evicted_indices)
        return resolved

    @property
    def folded(self) -> bool:
        return self.score_layout == "folded"

    @property
    def tokens(self) -> int:
        """Scores per layer the next step carries: the cache plus the new token."""
        return self.cache_size + 1


class SequenceBatch:
    """The sequences one worker rank steps together, over one StepStream.

    ``step({id: scores_or_None, ...})`` sends one report per sequence listed (the others do
    not step) and returns a dict of :class:`Decision` by sequence id. The batch numbers the
    steps, and remembers each sequence's cache size and whether its next step needs scores:
    ``needs_scores()`` tells the caller when it may skip capturing attention. A report that
    cannot be right (scores of the wrong size, no scores on a step that needs them) is
    rejected here without being sent, in a Decision like the daemon's; a rejected step
    changes nothing and may be sent again.

    Tensor parallelism: each rank makes its own batch (``client.batch(rank=p,
    head_count=h_p)``) and sends, per layer, the SUM of its heads' attention rows. One rank
    opens the sequence with ``tp_world_size``; the others ``add`` it. Every rank gets the
    same decisions; a rank's step returns once all ranks have reported it, so run the
    ranks in their own threads or processes.

    Transports: scores travel inline in the StepBatch, or, with ``score_region_bytes``,
    through a shared-memory :class:`~kvcache_client.region.ScoreRegion` the daemon reads in
    place (``score_region`` says how many reports went each way). ``step()`` is the same.

    Folded sequences (``open(..., score_layout="folded", layers=K)``) take one row per
    scoring step: ``fold_scores(rows, batch.sequences[id].fold_weights)``.

    Decision encodings (``open(..., decision_encoding="positions" | "mask" | "auto")``):
    the batch tracks each sequence's cached positions, so every decision it returns has
    both ``evicted`` (positions) and ``keep_mask()`` whichever form the daemon sent.

    Steps in flight (``max_inflight`` > 1): ``submit_step`` sends a step and returns a
    :class:`~kvcache_client.stream.StepFuture` at once, so that e.g. two micro-batches of
    sequences alternate, each computed while the other's decisions travel. A sequence may
    be in one step in flight at a time (SequenceInFlightError otherwise).

    Not thread-safe: one batch per rank, stepped from one thread (its futures may be waited
    on from any; the stream's reader thread updates the tracking of the sequences in flight).
    """

    def __init__(self, client: "KvCacheClient", *, rank: int = 0,
                 head_count: Optional[int] = None, timeout: Optional[float] = None,
                 score_region_bytes: Optional[int] = None,
                 daemon_score_region: bool = False, max_inflight: int = 1,
                 score_region_rank: Optional[int] = None) -> None:
        """``head_count``: query heads this rank sums into each row (default for its
        sequences; required for tensor-parallel ones). ``timeout``: seconds to wait for a
        step's decisions (default: the client's timeout). ``score_region_bytes``: send the
        scores through a shared-memory region of that size (KvCacheClient.stream), which
        the daemon creates with ``daemon_score_region``. ``max_inflight``: steps sent and
        not yet answered, at most (1: each step waits for the previous one's decisions);
        at most the daemon's --max_inflight_batches. ValueError outside 1..1024.
        ``score_region_rank``: the GPU of the created region (KvCacheClient.stream)."""
        self._client = client
        self.rank = rank
        self.head_count = head_count
        self._stream = client.stream(rank=rank,
                                     timeout=timeout if timeout is not None else client.timeout,
                                     score_region_bytes=score_region_bytes,
                                     daemon_score_region=daemon_score_region,
                                     max_inflight=max_inflight,
                                     score_region_rank=score_region_rank)
        self._sequences: Dict[str, TrackedSequence] = {}
        # Sequence id -> the claim of the step in flight it is in (see _claim).
        self._in_flight: Dict[str, int] = {}
        self._in_flight_lock = threading.Lock()
        self._claims = itertools.count(1)

    @property
    def max_inflight(self) -> int:
        """Steps that may be in flight together."""
        return self._stream.max_inflight

    @property
    def score_region(self) -> Optional["ScoreRegion"]:
        """The shared-memory region the scores go through (None: inline). Its
        ``region_reports`` and ``inline_reports`` count the reports sent each way."""
        return self._stream.score_region

    # -- membership -----------------------------------------------------------------------

    def open(self, sequence_id: str, prefill_len: int, *, head_count: Optional[int] = None,
             **options: Any) -> SequenceState:
        """Opens a sequence on the daemon (``KvCacheClient.open_sequence`` options) and adds
        it to this batch."""
        self._head_count_for(sequence_id, options.get("tp_world_size", 1), head_count)
        state = self._client.open_sequence(sequence_id, prefill_len, **options)
        self.add(sequence_id, state=state, head_count=head_count)
        return state

    def add(self, sequence_id: str, *, state: Optional[SequenceState] = None,
            head_count: Optional[int] = None) -> TrackedSequence:
        """Adds an open sequence (e.g. one another rank opened), from ``state`` or, when not
        given, from ``inspect``. Raises KvCacheError NOT_FOUND when it is not open, and
        SequenceInFlightError when this batch has it in a step in flight."""
        if sequence_id in self.in_flight:
            raise self._in_flight_error(sequence_id)
        if state is None or (state.last_step > 0 and len(state.positions) != state.cache_size):
            # The cached positions are tracked from here on (for masks): a state past its
            # first step must carry them.
            state = self._client.inspect(sequence_id, include_cache=True)
        positions = (range(state.prefill_len) if state.last_step == 0 and not state.positions
                     else state.positions)
        tracked = TrackedSequence(
            sequence_id=sequence_id, last_step=state.last_step, cache_size=state.cache_size,
            next_needs_scores=state.next_needs_scores, tp_world_size=state.tp_world_size,
            head_count=self._head_count_for(sequence_id, state.tp_world_size, head_count),
            score_dtype=state.score_dtype, score_layout=state.score_layout,
            layers=state.layers, fold_weights=state.fold_weights,
            decision_encoding=state.decision_encoding, prefill_len=state.prefill_len,
            cache=CachePositions(positions))
        self._sequences[sequence_id] = tracked
        return tracked

    def import_sequence(self, sequence_id: str, source: str, *,
                        head_count: Optional[int] = None,
                        timeout: Optional[float] = None) -> ImportedSequence:
        """Moves a sequence from the kvcached at ``source`` into this batch's daemon
        (``KvCacheClient.import_sequence``) and tracks it here from the imported state:
        its next step is the one after the source's last (docs/DISAGGREGATION.md). The
        worker that stepped it on the source must stop (``remove`` it there): the source
        has closed it. Raises KvCacheError as ``import_sequence`` (nothing tracked then)."""
        imported = self._client.import_sequence(sequence_id, source, timeout=timeout)
        self.add(sequence_id, state=imported.state, head_count=head_count)
        return imported

    def remove(self, sequence_id: str) -> None:
        """Stops stepping a sequence here (it stays open on the daemon)."""
        self._sequences.pop(sequence_id, None)

    def close_sequence(self, sequence_id: str) -> SequenceStats:
        """Closes the sequence on the daemon and removes it; returns its totals."""
        try:
            return self._client.close_sequence(sequence_id)
        finally:
            self.remove(sequence_id)

    def _head_count_for(self, sequence_id: str, tp_world_size: int,
                        head_count: Optional[int]) -> int:
        count = head_count if head_count is not None else self.head_count
        if tp_world_size > 1 and not count:
            raise ValueError(
                f"sequence {sequence_id!r} has {tp_world_size} tensor-parallel ranks: give "
                "head_count (the query heads this rank sums into each row)")
        return count or 0

    @property
    def sequences(self) -> Mapping[str, TrackedSequence]:
        """The tracked sequences by id (read-only view)."""
        return types.MappingProxyType(self._sequences)

    def __contains__(self, sequence_id: object) -> bool:
        return sequence_id in self._sequences

    def __len__(self) -> int:
        return len(self._sequences)

    def needs_scores(self, sequence_id: Optional[str] = None) -> bool:
        """Whether the next step of ``sequence_id`` (None: of any sequence here not in a
        step in flight) needs scores. SequenceInFlightError for a sequence in flight: that
        is known only once its decision arrives."""
        in_flight = self.in_flight
        if sequence_id is not None:
            if sequence_id in in_flight:
                raise self._in_flight_error(sequence_id)
            return self._sequences[sequence_id].next_needs_scores
        return any(s.next_needs_scores for s in self._sequences.values()
                   if s.sequence_id not in in_flight)

    # -- stepping -------------------------------------------------------------------------

    def step(self, scores: Mapping[str, ScoresLike], *, dtype: Optional[str] = None,
             layers: Optional[int] = None, raise_on_error: bool = False) -> Dict[str, Decision]:
        """Steps the listed sequences once; returns their decisions by id, in input order.

        Args:
          scores: sequence id -> its layer scores for this step (anything ``encode_scores``
            takes, a :class:`Scores` to give that entry its own layers/dtype), or None on a
            step that needs none.
          dtype: wire dtype for every entry (default: the input's own, else the sequence's).
          layers: layer count for flat inputs (default: from the shape or the cache size).
          raise_on_error: raise StepError for the first rejected step (its ``decisions``
            holds them all) instead of returning rejections in the dict.
        Raises:
          KeyError: an id this batch does not track (``open`` or ``add`` it first).
          SequenceInFlightError: a listed sequence is in a step still in flight.
          TypeError: scores of an unsupported kind.
          KvCacheError: the stream failed (the batch is then unusable: make a new one and
            ``add`` the sequences, which resynchronizes them with the daemon); INTERNAL
            when a decision does not fit the tracked cache (resynchronize the same way).
        """
        return self.submit_step(scores, dtype=dtype, layers=layers,
                                raise_on_error=raise_on_error).result()

    def submit_step(self, scores: Mapping[str, ScoresLike], *, dtype: Optional[str] = None,
                    layers: Optional[int] = None, raise_on_error: bool = False) -> StepFuture:
        """:meth:`step` without waiting: sends the step and returns a :class:`StepFuture`
        whose ``result()`` is what ``step`` returns (or raises what it raises, past the
        KeyError, SequenceInFlightError and TypeError raised here, before sending).

        Up to ``max_inflight`` steps are in flight; one more blocks until the oldest is
        answered. A sequence may be in one of them only: its next step (number, whether it
        needs scores) depends on that decision. Each sequence's tracking is updated when its
        reply arrives, before the future is done.
        """
        for sequence_id in scores:
            self._tracked(sequence_id)
        claim = self._claim(list(scores))
        try:
            decisions, reports = self._reports(scores, dtype, layers)

            def build(region: Optional["ScoreRegion"]) -> List[pb.StepReport]:
                # Under the stream's lock, once the region may be written from its window's start.
                return [report_message(*report, region) for _, report in reports]

            def settle(got: List[Decision]) -> Dict[str, Decision]:
                # On the stream's reader thread, before the future is done.
                try:
                    return self._settle(decisions, [sid for sid, _ in reports], got,
                                        raise_on_error)
                finally:
                    self._release(claim)

            future = self._stream.submit_built(build, settle)
        except BaseException:
            self._release(claim)
            raise
        # A failed stream never settles: free the sequences for the error to be seen.
        future.add_done_callback(lambda done: self._release(claim))
        return future

    def _reports(self, scores: Mapping[str, ScoresLike], dtype: Optional[str],
                 layers: Optional[int]
                 ) -> Tuple[Dict[str, Optional[Decision]], List[Tuple[str, _ReportArgs]]]:
        """The decisions by id, None where a report is to be sent (the client's rejections
        filled in), and the reports to send."""
        decisions: Dict[str, Optional[Decision]] = {}
        reports: List[Tuple[str, _ReportArgs]] = []
        for sequence_id, value in scores.items():
            tracked = self._sequences[sequence_id]
            try:
                prepared = self._prepare(tracked, value, dtype, layers)
            except ScoreShapeError as error:
                decisions[sequence_id] = Decision.rejected(
                    sequence_id, tracked.next_step, grpc.StatusCode.INVALID_ARGUMENT,
                    f"sequence {sequence_id!r} step {tracked.next_step}: {error} "
                    "(rejected by the client, not sent)",
                    tracked.cache_size, tracked.next_needs_scores)
                continue
            decisions[sequence_id] = None
            reports.append((sequence_id, (sequence_id, tracked.next_step, tracked.head_count,
                                          prepared)))
        return decisions, reports

    def _settle(self, decisions: Dict[str, Optional[Decision]], sent: List[str],
                got: List[Decision], raise_on_error: bool) -> Dict[str, Decision]:
        """Applies the daemon's decisions to the tracked sequences; the step's result."""
        for sequence_id, decision in zip(sent, got):
            if decision.ok:
                tracked = self._sequences.get(sequence_id)
                if tracked is not None:
                    decision = self._advance(tracked, decision)
            decisions[sequence_id] = decision
        result: Dict[str, Decision] = decisions  # type: ignore[assignment]  # all filled
        if raise_on_error:
            for decision in result.values():
                if not decision.ok:
                    raise StepError(decision.sequence_id, decision.step, decision.code,
                                    decision.message, decisions=result)
        return result

    @staticmethod
    def _advance(tracked: TrackedSequence, decision: Decision) -> Decision:
        try:
            decision = tracked.resolve(decision)
        except ValueError as error:
            raise KvCacheError(grpc.StatusCode.INTERNAL,
                               f"{error}; make a new batch and add() the sequence to "
                               "resynchronize it") from None
        tracked.last_step = decision.step
        tracked.cache_size = decision.cache_size
        tracked.next_needs_scores = decision.next_needs_scores
        return decision

    # -- steps in flight ------------------------------------------------------------------

    def _claim(self, sequence_ids: List[str]) -> Tuple[int, List[str]]:
        """Marks the sequences as in a step in flight; SequenceInFlightError (nothing
        marked) when one already is."""
        with self._in_flight_lock:
            for sequence_id in sequence_ids:
                if sequence_id in self._in_flight:
                    raise self._in_flight_error(sequence_id)
            token = next(self._claims)
            for sequence_id in sequence_ids:
                self._in_flight[sequence_id] = token
        return token, sequence_ids

    def _release(self, claim: Tuple[int, List[str]]) -> None:
        """Unmarks a claim's sequences (those a later claim took are not its to free)."""
        token, sequence_ids = claim
        with self._in_flight_lock:
            for sequence_id in sequence_ids:
                if self._in_flight.get(sequence_id) == token:
                    del self._in_flight[sequence_id]

    def _in_flight_error(self, sequence_id: str) -> SequenceInFlightError:
        tracked = self._sequences.get(sequence_id)
        step = f"step {tracked.next_step}" if tracked is not None else "a step"
        return SequenceInFlightError(
            f"sequence {sequence_id!r} is in a step still in flight ({step} was sent and "
            "its decision has not arrived): wait for that step's result() first, since its "
            "next step depends on that decision")

    @property
    def in_flight(self) -> FrozenSet[str]:
        """The ids of the sequences in a step sent and not yet answered."""
        with self._in_flight_lock:
            return frozenset(self._in_flight)

    def _tracked(self, sequence_id: str) -> TrackedSequence:
        try:
            return self._sequences[sequence_id]
        except KeyError:
            raise KeyError(f"sequence {sequence_id!r} is not in this batch; open() or add() "
                           "it first") from None

    def _prepare(self, tracked: TrackedSequence, value: ScoresLike, dtype: Optional[str],
                 layers: Optional[int]) -> Optional[PreparedScores]:
        if value is None and tracked.next_needs_scores:
            what = "one folded row" if tracked.folded else "per layer"
            raise ScoreShapeError(f"this step needs scores ({tracked.tokens} {what}) and "
                                  "none were given")
        report = Report(tracked.sequence_id, tracked.next_step, value, layers=layers,
                        dtype=dtype, head_count=tracked.head_count)
        # Sizes are checked only where the daemon uses the scores; on other steps it
        # ignores them (and counts them).
        tokens = tracked.tokens if tracked.next_needs_scores else None
        prepared = report.prepare(default_dtype=tracked.score_dtype, tokens=tokens)
        if prepared is not None and tracked.folded and prepared.layers != 1:
            raise ScoreShapeError(
                f"the sequence is folded ({tracked.layers} layers into one row) and these "
                f"scores have {prepared.layers} rows: send "
                "fold_scores(rows, batch.sequences[id].fold_weights)")
        return prepared

    # -- life -----------------------------------------------------------------------------

    def close(self) -> None:
        """Ends the stream (and unregisters and unlinks its score region). The sequences
        stay open on the daemon (``close_sequence`` them)."""
        self._stream.close()

    def __enter__(self) -> "SequenceBatch":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
