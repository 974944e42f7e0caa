"""SPEC.md's per-layer rule in float64, run alongside a daemon's decisions, to check the
decisions of folded sequences: those are the per-layer rule with other float32 rounding,
so they need not match bit for bit, but every token evicted at a step must have a
per-layer momentum not above any kept unprotected token's, within a relative 2e-4.

With ``span_pool`` (SPEC.md "Span pooling") each row is max-pooled over positions before
the update: the layer rows per layer, or (``folded``) the folded row, folded in double
first. ``decide`` makes the decisions itself (the golden vectors of span pooling,
tests/python/make_span_pool_golden.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from golden import Trace
from kvcache_client import budget_tokens

SCORING = ("ema", "cumulative", "single_step")
RELATIVE = 2e-4


def budget(header: Dict[str, Any]) -> int:
    if "budget_tokens" in header:
        return header["budget_tokens"]
    return budget_tokens(header["prefill_len"], header["compression_ratio"])


def span_pool(row: Sequence[float], positions: Sequence[int], k: int) -> List[float]:
    """SPEC.md "Span pooling": each entry becomes the max of the entries whose POSITION is
    within (k - 1) / 2 of its own (k <= 1: the row unchanged). Plain O(n * window)."""
    if k <= 1:
        return list(row)
    half = (k - 1) // 2
    out = []
    for i, p in enumerate(positions):
        out.append(max(v for v, q in zip(row, positions) if abs(q - p) <= half))
    return out


def fold_weights(aggregation: str, alpha: float, layers: int) -> Tuple[List[float], float]:
    """SPEC.md "Folded reports": (w_l for l = 0 .. K-1, decay), in double."""
    if aggregation == "ema":
        return [(1 - alpha) * alpha ** (layers - 1 - l) for l in range(layers)], alpha ** layers
    if aggregation == "cumulative":
        return [1.0] * layers, 1.0
    return [1.0 / layers] * layers, 0.0


class PerLayerMomentum:
    """The momentum of every cached token under the per-layer rule, in float64, following
    the cache the daemon's decisions leave."""

    def __init__(self, trace: Trace, folded: bool = False) -> None:
        policy = trace.header["policy"]
        self.span_pool = policy.get("span_pool", 0)
        self.folded = folded
        self.aggregation = policy.get("aggregation", "ema")
        self.alpha = policy.get("alpha", 0.8)
        self.refresh = policy.get("refresh", "every_step")
        self.interval = policy.get("refresh_interval", 4)
        self.sinks = policy.get("protect_sinks", 0)
        self.recent = policy.get("protect_recent", 0)
        self.prefill = trace.header["prefill_len"]
        self.budget = budget(trace.header)
        self.cache: List[int] = list(range(self.prefill))
        self.momentum: Dict[int, float] = {p: 0.0 for p in self.cache}
        self.worst_margin = float("inf")  # the smallest relative gap seen (negative: inverted)

    def scoring(self, step: int) -> bool:
        if self.aggregation not in SCORING:
            return False
        if self.refresh == "lazy":
            return (step - 1) % self.interval == 0
        if self.refresh == "score_free":
            return step == 1
        return True

    def step(self, step: int, layers: Optional[List[List[float]]],
             decision: Dict[str, Any]) -> float:
        """Applies step ``step`` (its per-layer rows) and checks the daemon's ``decision``
        against the float64 momentum; returns the step's relative margin (the gap between
        the highest evicted and the lowest kept unprotected momentum; inf when nothing
        competed)."""
        new = self.prefill + step - 1
        scoring = self.scoring(step)
        m = self.momentum
        if scoring:
            m[new] = 0.0
        else:
            m[new] = sum(m[p] for p in self.cache) / len(self.cache) if self.cache else 0.0
        self.cache.append(new)
        if scoring:
            assert layers, f"step {step} is a scoring step and the trace has no scores"
            assert all(len(row) == len(self.cache) for row in layers)
            self.apply(layers)
        return self.check(step, decision)

    def apply(self, layers: List[List[float]]) -> None:
        """A scoring step's update of the cache (the new token included)."""
        m = self.momentum
        if self.folded and self.span_pool > 1:
            weights, decay = fold_weights(self.aggregation, self.alpha, len(layers))
            row = [sum(w * r[i] for w, r in zip(weights, layers)) for i in range(len(self.cache))]
            row = span_pool(row, self.cache, self.span_pool)
            for i, p in enumerate(self.cache):
                m[p] = decay * m[p] + row[i]
            return
        layers = [span_pool(row, self.cache, self.span_pool) for row in layers]
        if self.aggregation == "single_step":
            for i, p in enumerate(self.cache):
                m[p] = sum(row[i] for row in layers) / len(layers)
        for row in layers if self.aggregation != "single_step" else ():
            for i, p in enumerate(self.cache):
                if self.aggregation == "ema":
                    m[p] = self.alpha * m[p] + (1 - self.alpha) * row[i]
                else:
                    m[p] = m[p] + row[i]

    def decide(self, step: int, layers: Optional[List[List[float]]]) -> Tuple[Dict[str, Any], float]:
        """Step ``step`` decided by this model (lowest momentum first, ties to the lower
        position, protections honoured): (the decision, its relative margin: the smallest
        gap between an evicted and a kept eligible token of different momentum)."""
        new = self.prefill + step - 1
        scoring = self.scoring(step)
        m = self.momentum
        m[new] = 0.0 if scoring or not self.cache else sum(m[p] for p in self.cache) / len(self.cache)
        self.cache.append(new)
        if scoring:
            self.apply(layers)
        eligible = [p for p in self.cache[:len(self.cache) - self.recent] if p >= self.sinks]
        excess = max(0, len(self.cache) - self.budget)
        ranked = sorted(eligible, key=lambda p: (m[p], p))
        evicted, kept = sorted(ranked[:excess]), ranked[excess:]
        margin = float("inf")
        for e in evicted:
            for u in kept:
                if m[e] != m[u]:
                    margin = min(margin, abs(m[u] - m[e]) / max(abs(m[u]), abs(m[e])))
        gone = set(evicted)
        self.cache = [p for p in self.cache if p not in gone]
        for p in gone:
            del m[p]
        decision = {"step": step, "evicted": evicted, "cache_size": len(self.cache),
                    "next_needs_scores": self.scoring(step + 1)}
        return decision, margin

    def check(self, step: int, decision: Dict[str, Any]) -> float:
        """Checks the daemon's ``decision`` of ``step`` against the float64 momentum and
        applies its evictions; returns the relative margin (see step)."""
        m = self.momentum
        evicted = decision["evicted"]
        where = f"step {step}"
        assert evicted == sorted(set(evicted)), f"{where}: evicted {evicted} not ascending"
        assert set(evicted) <= set(self.cache), f"{where}: evicted uncached {evicted}"
        protected = {p for p in self.cache if p < self.sinks}
        if self.recent:
            protected |= set(self.cache[-self.recent:])
        assert not protected & set(evicted), f"{where}: evicted protected tokens"
        gone = set(evicted)
        self.cache = [p for p in self.cache if p not in gone]
        assert len(self.cache) == decision["cache_size"] == min(self.budget, len(self.cache)
                                                                + len(gone)), where
        kept = [m[p] for p in self.cache if p not in protected]
        margin = float("inf")
        if evicted and kept:
            high = max(m[p] for p in evicted)
            low = min(kept)
            scale = max(abs(high), abs(low))
            margin = (low - high) / scale if scale else 0.0
            assert high <= low + RELATIVE * scale, (
                f"{where}: evicted a token of per-layer momentum {high!r} while keeping "
                f"one of {low!r} (relative {margin:.3g}, allowed -{RELATIVE})")
        for p in gone:
            del m[p]
        self.worst_margin = min(self.worst_margin, margin)
        return margin
