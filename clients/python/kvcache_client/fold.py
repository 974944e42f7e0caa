"""Folded reports: one row per step instead of one per layer.

The per-layer momentum update is linear, so K layer rows s_0 .. s_{K-1} of a step act on
the momentum m as ``m <- decay * m + sum_l layer_weights[l] * s_l``. A sequence opened
with ``score_layout="folded", layers=K`` takes that sum, the folded row, as its one row
per scoring step; its :class:`FoldWeights` come from the daemon (``SequenceState``), so a
worker never derives them. For ema ``layer_weights[l] = (1 - alpha) * alpha**(K-1-l)`` and
``decay = alpha**K``; cumulative: 1 and 1; single_step: 1/K and 0.

A tensor-parallel rank folds its heads' SUMS with the same weights and still reports its
head count: folding is linear, so the daemon's join (summed rows over summed head counts)
gives the fold of the mean-pooled rows.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import Any, Sequence, Tuple, Union

__all__ = ["FoldWeights", "fold_scores"]


@dataclass(frozen=True)
class FoldWeights:
    """How a folded sequence's K layer rows become its one row (``fold_scores``), and the
    factor the daemon applies to the momentum before adding that row."""

    layer_weights: Tuple[float, ...]  #: K entries, layer 0 (the first the model runs) first
    decay: float

    @property
    def layers(self) -> int:
        return len(self.layer_weights)

    @classmethod
    def from_proto(cls, message: Any) -> "FoldWeights":
        return cls(tuple(message.layer_weights), message.decay)


WeightsLike = Union[FoldWeights, Sequence[float]]


def fold_scores(rows: Any, weights: WeightsLike) -> Any:
    """The folded row ``sum_l weights[l] * rows[l]`` of one step's layer rows.

    Args:
      rows: ``[K, tokens]``: a numpy array, a torch tensor (any float dtype, CPU or CUDA),
        a sequence of K 1-D arrays or tensors (stacked first), or K rows of floats.
      weights: a :class:`FoldWeights` (``batch.sequences[id].fold_weights``) or K floats.
    Returns:
      ``[tokens]`` float32 of the same kind: a numpy array, a tensor on the rows' device,
      or a list of floats (float32 values). Accumulated in float64 (torch on a device
      without float64, e.g. MPS: float32).
    Raises:
      ValueError: rows that are not 2-D, or a layer count the weights do not cover.
    """
    factors = tuple(float(w) for w in (weights.layer_weights if isinstance(weights, FoldWeights)
                                       else weights))
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    if isinstance(rows, (list, tuple)) and rows:
        if torch is not None and isinstance(rows[0], torch.Tensor):
            rows = torch.stack(list(rows))
        elif numpy is not None and isinstance(rows[0], numpy.ndarray):
            rows = numpy.stack(rows)
    if torch is not None and isinstance(rows, torch.Tensor):
        _check(tuple(rows.shape), factors)
        wide = torch.float32 if rows.device.type == "mps" else torch.float64
        w = torch.tensor(factors, dtype=wide, device=rows.device)
        return (w @ rows.detach().to(wide)).to(torch.float32)
    if numpy is not None and isinstance(rows, numpy.ndarray):
        _check(rows.shape, factors)
        acc = numpy.zeros(rows.shape[1], dtype=numpy.float64)
        for factor, row in zip(factors, rows):
            acc += factor * row.astype(numpy.float64)
        return acc.astype(numpy.float32)
    listed = [row.tolist() if hasattr(row, "tolist") else list(row) for row in rows]
    width = len(listed[0]) if listed else 0
    if any(len(row) != width for row in listed):
        raise ValueError("rows differ in length; folding needs [layers, tokens]")
    _check((len(listed), width), factors)
    acc_list = [0.0] * width
    for factor, row in zip(factors, listed):
        for i, value in enumerate(row):
            acc_list[i] += factor * value
    return array("f", acc_list).tolist()


def _check(shape: Tuple[int, ...], factors: Tuple[float, ...]) -> None:
    if len(shape) != 2:
        raise ValueError(f"rows must be 2-D [layers, tokens], not of shape {shape}")
    if shape[0] != len(factors) or not factors:
        raise ValueError(f"rows have {shape[0]} layers, the fold weights cover "
                         f"{len(factors)}")
