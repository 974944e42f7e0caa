"""Paired bootstrap intervals for the differences the evaluation page states.

Two configurations run on the same samples give paired outcomes (a sample's accuracy, 0
or 1, or the share of its evidence kept): the difference of their means is estimated by
the mean of the per-sample differences, and its interval by resampling the samples with
replacement (the pairs stay together, so what the samples share cancels), ``resamples``
times from a fixed seed, and taking the percentiles of the resampled means. Deterministic
for a given seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

RESAMPLES = 2000
SEED = 20240
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A difference of means and its bootstrap interval."""

    estimate: float   #: mean of the per-sample differences (treated - control)
    low: float
    high: float
    samples: int
    resamples: int
    level: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def text(self, digits: int = 2) -> str:
        """``+0.16 [+0.09, +0.23]``."""
        f = f"{{:+.{digits}f}}"
        return f"{f.format(self.estimate)} [{f.format(self.low)}, {f.format(self.high)}]"


def paired_difference(treated: Sequence[float], control: Sequence[float], *,
                      resamples: int = RESAMPLES, seed: int = SEED,
                      level: float = LEVEL) -> Interval:
    """``mean(treated - control)`` over paired samples, with its percentile bootstrap
    interval at ``level``: of the ``resamples`` means of resampled differences (sorted),
    the ``floor(a R)``-th and the ``(ceil((1 - a) R) - 1)``-th (0-based), ``a = (1 -
    level) / 2``.

    Raises:
      ValueError: sequences of different lengths, no samples, ``resamples < 1``, a level
        outside (0, 1), values that are not finite.
    """
    if len(treated) != len(control):
        raise ValueError(f"paired outcomes differ in length: {len(treated)} treated, "
                         f"{len(control)} control")
    if not treated:
        raise ValueError("no samples to compare")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an integer >= 1, got {resamples!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    diff = np.asarray(treated, dtype=np.float64) - np.asarray(control, dtype=np.float64)
    if not np.isfinite(diff).all():
        raise ValueError("outcomes must be finite")
    n = len(diff)
    rng = np.random.default_rng(seed)
    means = np.sort(diff[rng.integers(0, n, size=(resamples, n))].mean(axis=1))
    tail = (1 - level) / 2
    # 1e-9: so that a level like 0.9 (a tail of 0.04999...) gives the order statistic
    # its decimal value names.
    low = means[min(resamples - 1, int(math.floor(tail * resamples + 1e-9)))]
    high = means[max(0, int(math.ceil((1 - tail) * resamples - 1e-9)) - 1)]
    return Interval(float(diff.mean()), float(low), float(high), n, resamples, level)
