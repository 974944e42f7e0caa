"""The decode loop: steps a batch's sequences with their KV caches, capturing scores only
on the steps that need them.

Not thread-safe: a loop belongs to one worker thread.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Mapping, Optional

from .caches import KvCache
from .capture import SCORERS, ObservationWindow, StepScores


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
    decisions: the daemon round trip), ``apply_s`` (applying them to the caches).

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
                                        "step_s": 0.0, "apply_s": 0.0}

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
        self.caches.pop(sequence_id, None)
        self.windows.pop(sequence_id, None)

    def begin(self) -> Dict[str, Optional[StepScores]]:
        """The captures of the next step: a :class:`StepScores` for each sequence whose
        step needs scores, None for the others."""
        captures: Dict[str, Optional[StepScores]] = {}
        for sequence_id in self.caches:
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
        their caches; returns the decisions. Raises StepError (nothing applied) when the
        daemon rejects one."""
        reports = {sid: (None if c is None else c.report()) for sid, c in captures.items()}
        built = time.perf_counter()
        decisions = self.batch.step(reports, dtype=self.dtype, raise_on_error=True)
        sent = time.perf_counter()
        for sequence_id, decision in decisions.items():
            self.caches[sequence_id].apply(decision)
            self.windows.pop(sequence_id, None)  # step 1 is decided: the window is spent
        done = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["scoring_steps"] += any(c is not None for c in captures.values())
        self.stats["capture_s"] += sum(c.seconds for c in captures.values() if c is not None)
        self.stats["step_s"] += sent - built
        self.stats["apply_s"] += done - sent
        return decisions
