"""The decode loop: steps a batch's sequences with their KV caches, capturing scores only
on the steps that need them.

Not thread-safe: a loop belongs to one worker thread.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Mapping, Optional

from .caches import KvCache
from .capture import SCORERS, StepScores


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
    """

    def __init__(self, batch: Any, *, scorer: str = "attention",
                 dtype: Optional[str] = None) -> None:
        """``scorer``: see :data:`SCORERS`. ``dtype``: wire dtype of the scores (default:
        each sequence's ``score_dtype``)."""
        if scorer not in SCORERS:
            raise ValueError(f"unknown scorer {scorer!r}; use one of {SCORERS}")
        self.batch = batch
        self.scorer = scorer
        self.dtype = dtype
        self.caches: Dict[str, KvCache] = {}
        self.stats: Dict[str, float] = {"steps": 0, "scoring_steps": 0, "capture_s": 0.0,
                                        "step_s": 0.0, "apply_s": 0.0}

    def add(self, sequence_id: str, cache: KvCache) -> None:
        """Steps ``sequence_id`` (tracked by the batch) with ``cache`` from now on."""
        if sequence_id not in self.batch:
            raise KeyError(f"sequence {sequence_id!r} is not in the batch; open() it first")
        self.caches[sequence_id] = cache

    def remove(self, sequence_id: str) -> None:
        self.caches.pop(sequence_id, None)

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
                fold_weights=tracked.fold_weights if tracked.folded else None)
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
        done = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["scoring_steps"] += any(c is not None for c in captures.values())
        self.stats["capture_s"] += sum(c.seconds for c in captures.values() if c is not None)
        self.stats["step_s"] += sent - built
        self.stats["apply_s"] += done - sent
        return decisions
