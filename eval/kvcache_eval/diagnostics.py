"""The eviction-quality diagnostics of docs/METRICS.md, computed offline from the harness's
step traces, to check the daemon's live figures (/metrics) against.

A trace (``RunConfig(trace=True)``) records per decode step what the worker saw: the
candidates (the cache before the step plus the new token, ascending positions), the score
row it sent (None on a step that needed none), the evicted positions, and the cache and
its momentum after the step (``InspectSequence`` with the cache). From those, this module
recomputes the figures by the definitions of cache_manager/engine/diagnostics.h, written again
here from the definitions, not from the C++:

- k = ceil(B / 10); raw top-k R_t: the k candidates with the highest raw score (the
  folded row, float32 as the daemon read it); momentum top-k M_t: the k cached tokens
  with the highest momentum; of equal values the higher position is in the set;
- a scoring step is measured when the previous scoring step was examined too (with
  ``--diagnostics_every 1`` every scoring step from the second on);
- raw churn 1 - J(R_t, R_t'), momentum churn 1 - J(M_t, M_t'), J(R_t, M_t), small change
  |M_t minus M_t'| <= 1, evicted, evicted while in R_t.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set

import torch

#: the figures of one policy: counters and histogram sums, as /metrics exports them
FIGURES = ("steps", "small_change", "evicted", "evicted_relevant", "raw_churn_sum",
           "momentum_churn_sum", "jaccard_sum")
COUNTS = FIGURES[:4]


@dataclass
class StepTrace:
    """One decode step of one sequence, as the worker saw it."""

    step: int
    candidates: List[int]          #: cache before the step plus the new token, ascending
    row: Optional[List[float]]     #: the folded score row sent (None: no scores needed)
    evicted: List[int]             #: positions the decision evicted
    retained: List[int]            #: the cache after the step, ascending
    momentum: List[float]          #: their momentum, in the order of ``retained``


@dataclass
class SequenceTrace:
    policy: str                    #: the preset (the daemon's ``policy`` label)
    budget: int
    score_dtype: str
    steps: List[StepTrace] = field(default_factory=list)


def top_k(positions: Sequence[int], values: Sequence[float], k: int) -> Set[int]:
    """The min(k, n) positions of the highest values; ties: the higher position first."""
    order = sorted(range(len(positions)), key=lambda i: (-values[i], -positions[i]))
    return {positions[i] for i in order[:k]}


def _jaccard(a: Set[int], b: Set[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _as_read(row: Sequence[float], dtype: str) -> List[float]:
    """The row as the daemon read it: rounded to the wire dtype, widened to float32."""
    wire = torch.tensor(row, dtype=torch.float64).to(getattr(torch, dtype))
    return wire.to(torch.float32).tolist()


def empty() -> Dict[str, float]:
    return {name: 0.0 for name in FIGURES}


def offline_figures(traces: Iterable[SequenceTrace]) -> Dict[str, Dict[str, float]]:
    """{policy: {figure: value}} over every measured step of ``traces`` (FIGURES)."""
    out: Dict[str, Dict[str, float]] = {}
    for trace in traces:
        totals = out.setdefault(trace.policy, empty())
        k = max(1, math.ceil(trace.budget / 10))
        previous = None  # (R, M) of the previous scoring step
        for step in trace.steps:
            if step.row is None:
                continue  # not a scoring step: neither examined nor measured
            raw = top_k(step.candidates, _as_read(step.row, trace.score_dtype), k)
            mom = top_k(step.retained, step.momentum, k)
            if previous is not None:
                prev_raw, prev_mom = previous
                totals["steps"] += 1
                totals["raw_churn_sum"] += 1 - _jaccard(raw, prev_raw)
                totals["momentum_churn_sum"] += 1 - _jaccard(mom, prev_mom)
                totals["jaccard_sum"] += _jaccard(raw, mom)
                totals["small_change"] += len(mom - prev_mom) <= 1
                totals["evicted"] += len(step.evicted)
                totals["evicted_relevant"] += len(set(step.evicted) & raw)
            previous = (raw, mom)
    return out


_METRIC = {
    "kvcache_diag_steps_total": "steps",
    "kvcache_diag_small_change_steps_total": "small_change",
    "kvcache_diag_evicted_total": "evicted",
    "kvcache_diag_evicted_relevant_total": "evicted_relevant",
    "kvcache_diag_raw_topk_churn_sum": "raw_churn_sum",
    "kvcache_diag_momentum_topk_churn_sum": "momentum_churn_sum",
    "kvcache_diag_raw_momentum_jaccard_sum": "jaccard_sum",
}
_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\}\s+(\S+)$')


def live_figures(metrics_text: str) -> Dict[str, Dict[str, float]]:
    """{policy: {figure: value}} from a /metrics scrape (Prometheus text format)."""
    out: Dict[str, Dict[str, float]] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in _METRIC:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        policy = out.setdefault(labels.get("policy", ""), empty())
        policy[_METRIC[match.group(1)]] += float(match.group(3))
    return out


#: the dashboard's readings, in the order of ``means``
READINGS = ("raw top-k churn", "momentum top-k churn", "raw/momentum Jaccard",
            "small-change share", "evicted while relevant")


def means(figures: Dict[str, float]) -> Dict[str, float]:
    """The dashboard's readings of one policy's figures (docs/METRICS.md)."""
    steps = figures["steps"] or math.nan
    evicted = figures["evicted"] or math.nan
    return dict(zip(READINGS, (figures["raw_churn_sum"] / steps,
                               figures["momentum_churn_sum"] / steps,
                               figures["jaccard_sum"] / steps, figures["small_change"] / steps,
                               figures["evicted_relevant"] / evicted)))


def agree(live: Dict[str, float], offline: Dict[str, float]) -> bool:
    """The counts equal and the sums within 1e-9 (the order of a double's additions)."""
    return all(live.get(n, 0.0) == offline.get(n, 0.0) if n in COUNTS
               else math.isclose(live.get(n, 0.0), offline.get(n, 0.0), rel_tol=1e-9,
                                 abs_tol=1e-9) for n in FIGURES)
