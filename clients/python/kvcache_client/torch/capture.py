"""Score capture: one decode step's attention rows, in the shape kvcached takes.

See the package docstring (kvcache_client.torch) for the shapes and the scorers.
Not thread-safe: a capture belongs to one worker thread.
"""

from __future__ import annotations

import math
import time
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from ..fold import FoldWeights

#: Scorers: plain attention; VNorm (each token's attention times the mean-normalized L2
#: norm of its value vector, per KV head, before pooling); entropy (the pooled row times
#: its normalized entropy H / log n, a per-layer scalar that keeps the row's order).
SCORERS = ("attention", "vnorm", "entropy")

Tensor = torch.Tensor


def attention_weights(q: Tensor, keys: Tensor, *, lengths: Optional[Any] = None,
                      scale: Optional[float] = None) -> Tensor:
    """Softmax attention of the new token's query heads over ``keys``.

    Args:
      q: ``[heads, d]`` or ``[batch, heads, d]``.
      keys: ``[kv_heads, n, d]`` or ``[batch, kv_heads, n, d]``; ``heads`` a multiple of
        ``kv_heads`` (GQA).
      lengths: batched only: the valid keys of each sequence (the rest is padding and gets
        weight 0). Default: all ``n``.
      scale: the logit scale, default ``1 / sqrt(d)``.
    Returns:
      ``[heads, n]`` or ``[batch, heads, n]`` (float32; float64 for float64 inputs); each
      head's row sums to 1 over the valid keys.
    Raises:
      ValueError: shapes that do not fit.
    """
    batched = q.dim() == 3
    qb, kb = (q, keys) if batched else (q.unsqueeze(0), keys.unsqueeze(0))
    if qb.dim() != 3 or kb.dim() != 4:
        raise ValueError(f"q must be [heads, d] or [batch, heads, d] and keys [kv_heads, n, "
                         f"d] or [batch, kv_heads, n, d]; got {tuple(q.shape)} and "
                         f"{tuple(keys.shape)}")
    batch, heads, d = qb.shape
    _, kv_heads, n, kd = kb.shape
    if kb.shape[0] != batch or kd != d:
        raise ValueError(f"q {tuple(q.shape)} and keys {tuple(keys.shape)} disagree on the "
                         "batch or the head dimension")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = heads // kv_heads
    qg = qb.to(wide).reshape(batch, kv_heads, group, d)
    logits = torch.matmul(qg, kb.to(wide).transpose(-1, -2))  # [batch, kv, group, n]
    logits = logits * (scale if scale is not None else 1.0 / math.sqrt(d))
    valid = _valid_mask(lengths, batch, n, keys.device) if batched else None
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = torch.softmax(logits, dim=-1).reshape(batch, heads, n)
    return weights if batched else weights[0]


def pool_weights(weights: Tensor, *, values: Optional[Tensor] = None,
                 scorer: str = "attention", lengths: Optional[Any] = None,
                 head_sum: bool = False) -> Union[Tensor, Tuple[Tensor, int]]:
    """Pools attention weights ``[heads, n]`` (or ``[batch, heads, n]``) into the row.

    For a model that has the weights already (eager attention, ``output_attentions``).
    ``values`` (``[kv_heads, n, d]``, batched ``[batch, kv_heads, n, d]``) are needed by
    ``scorer="vnorm"``. ``head_sum``: return ``(sum over these heads, head count)`` for a
    tensor-parallel rank instead of the mean. See :func:`attention_row`.
    """
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; use one of {SCORERS}")
    batched = weights.dim() == 3
    w = weights if batched else weights.unsqueeze(0)
    batch, heads, n = w.shape
    if not w.dtype.is_floating_point:
        raise ValueError(f"attention weights must be floats, not {w.dtype}")
    if w.dtype != torch.float64:
        w = w.float()
    valid = _valid_mask(lengths, batch, n, w.device) if batched else None
    if valid is not None:
        w = w.masked_fill(~valid[:, None, :], 0.0)
    if scorer == "vnorm":
        if values is None:
            raise ValueError("scorer='vnorm' needs the layer's values")
        vb = values if batched else values.unsqueeze(0)
        if vb.dim() != 4 or vb.shape[0] != batch or vb.shape[2] != n:
            raise ValueError(f"values {tuple(values.shape)} do not fit attention weights "
                             f"{tuple(weights.shape)}")
        kv_heads = vb.shape[1]
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
        norms = torch.linalg.vector_norm(vb.to(w.dtype), dim=-1)  # [batch, kv, n]
        if valid is not None:
            norms = norms.masked_fill(~valid[:, None, :], 0.0)
        counts = _valid_counts(lengths, batch, n, w.device, w.dtype)
        mean = norms.sum(-1, keepdim=True) / counts[:, None, None]
        factor = torch.where(mean > 0, norms / mean, torch.ones_like(norms))
        w = (w.reshape(batch, kv_heads, heads // kv_heads, n) * factor[:, :, None, :]) \
            .reshape(batch, heads, n)
    if head_sum:
        if scorer == "entropy":
            raise ValueError("scorer='entropy' weighs the pooled row of ALL heads; a "
                             "tensor-parallel rank's head sum cannot: gather the heads "
                             "first, or use 'attention' or 'vnorm'")
        row = w.sum(1)
        return (row if batched else row[0]), heads
    row = w.sum(1) / heads
    if scorer == "entropy":
        counts = _valid_counts(lengths, batch, n, w.device, w.dtype)
        total = row.sum(-1, keepdim=True).clamp_min(torch.finfo(row.dtype).tiny)
        p = row / total
        entropy = -(p * torch.log(p.clamp_min(torch.finfo(row.dtype).tiny))).sum(-1)
        log_n = torch.log(counts)
        factor = torch.where(log_n > 0, entropy / log_n.clamp_min(1e-30),
                             torch.ones_like(entropy))
        row = row * factor[:, None]
    return row if batched else row[0]


def attention_row(q: Tensor, keys: Tensor, *, values: Optional[Tensor] = None,
                  scorer: str = "attention", lengths: Optional[Any] = None,
                  head_sum: bool = False,
                  scale: Optional[float] = None) -> Union[Tensor, Tuple[Tensor, int]]:
    """One layer's scores of one decode step (SPEC.md "Terms", "Tensor-parallel ranks").

    Args:
      q: the new token's queries, ``[heads, d]`` or ``[batch, heads, d]``.
      keys: the layer's keys, the new token's included as the last valid one:
        ``[kv_heads, n, d]`` or ``[batch, kv_heads, n, d]``.
      values: like ``keys``; needed by ``scorer="vnorm"``.
      scorer: ``"attention"``, ``"vnorm"`` or ``"entropy"`` (see :data:`SCORERS`).
      lengths: batched only: valid keys per sequence (a list or a 1-D tensor).
      head_sum: for a tensor-parallel rank: return ``(sum of these heads' rows, heads)``
        (the daemon joins ``sum_p sums / sum_p heads``); not with ``"entropy"``.
      scale: logit scale, default ``1 / sqrt(d)`` (the model's own, if it differs).
    Returns:
      ``[n]`` or ``[batch, n]`` float32 (zeros past each length), or with ``head_sum`` the
      pair ``(sum, heads)``. Plain attention rows sum to 1 over the valid keys.
    Raises:
      ValueError: shapes that do not fit, an unknown scorer, vnorm without values.
    """
    weights = attention_weights(q, keys, lengths=lengths, scale=scale)
    return pool_weights(weights, values=values, scorer=scorer, lengths=lengths,
                        head_sum=head_sum)


def _valid_mask(lengths: Optional[Any], batch: int, n: int,
                device: torch.device) -> Optional[Tensor]:
    if lengths is None:
        return None
    lens = torch.as_tensor(lengths, device=device).reshape(-1)
    if lens.numel() != batch:
        raise ValueError(f"{lens.numel()} lengths for a batch of {batch}")
    if bool((lens < 1).any()) or bool((lens > n).any()):
        raise ValueError(f"lengths must be in 1..{n}, got {lens.tolist()}")
    return torch.arange(n, device=device)[None, :] < lens[:, None]


def _valid_counts(lengths: Optional[Any], batch: int, n: int, device: torch.device,
                  dtype: torch.dtype) -> Tensor:
    if lengths is None:
        return torch.full((batch,), float(n), device=device, dtype=dtype)
    return torch.as_tensor(lengths, device=device).reshape(-1).to(dtype)


class ObservationWindow:
    """The prompt's last queries' attention, gathered during prefill, that the capture of
    decode step 1 pools with the first decode query's (an observation window, as SnapKV's).

    Step 1 is the step that evicts ``L0 + 1 - B`` tokens at once, on the attention of one
    query; with a window its layer row is instead, per layer, the MEAN over ``m + 1``
    queries (``m = min(size, L0)``: the prompt queries at positions ``L0 - m ... L0 - 1``
    and the first decode query, at ``L0``) of their head-pooled attention rows, each a
    row over positions ``0 ... L0``: a prompt query's row is its causal softmax over the
    positions it sees and 0 at those it cannot (those after it, the new token at ``L0``
    included). Every query's row sums to 1, so the mean does too, as every later step's
    row: the momentum's scale does not change at step 1 (a sum would weigh step 1
    ``m + 1`` times as much as each later step under EMA, forever under ``cumulative``).
    Pooling over heads (mean, or a rank's head sum), the scorers and the fold then apply to
    this row as to a plain one; later steps are untouched. ``size = 0`` adds nothing: the
    row is the plain one, bit for bit.

    During prefill, per layer in model order: ``add(q, keys)``. Kept: one ``[heads, L0]``
    sum per layer, on the inputs' device (float32; float64 for float64 inputs); each
    ``add`` takes ``heads * m * L0`` more while it runs. Unbatched: one window per
    sequence (slice a batched prefill's queries and keys per sequence).
    """

    def __init__(self, size: int, *, scale: Optional[float] = None) -> None:
        """``size``: the prompt queries pooled (``w``; 0: none). ``scale``: the logit
        scale, default ``1 / sqrt(d)`` (the model's own, if it differs)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"observation window size must be an integer >= 0, got "
                             f"{size!r}")
        self.size = size
        self.scale = scale
        self.prefill_len: Optional[int] = None
        self.queries = 0             #: m = min(size, L0): the prompt queries pooled
        self.seconds = 0.0           #: host time spent in add() (on CUDA: not waiting)
        self._sums: List[Tensor] = []

    @property
    def layers(self) -> int:
        return len(self._sums)

    def add(self, q: Tensor, keys: Tensor) -> None:
        """Adds the next layer (in model order) from its prompt queries and keys.

        Args:
          q: ``[heads, t, d]``, this layer's queries of the prompt's LAST ``t`` positions
            (``t >= min(size, L0)``; all ``L0`` of them is fine: only the last ``m`` are
            read), RoPE applied as the model's attention applies it.
          keys: ``[kv_heads, L0, d]``, the layer's prompt keys (the cache's, RoPE applied).
        Raises:
          ValueError: shapes that do not fit one another or the layers added before.
        """
        start = time.perf_counter()
        if q.dim() != 3 or keys.dim() != 3:
            raise ValueError(f"q must be [heads, t, d] and keys [kv_heads, L0, d]; got "
                             f"{tuple(q.shape)} and {tuple(keys.shape)}")
        heads, t, d = q.shape
        kv_heads, prefill_len, kd = keys.shape
        if kd != d:
            raise ValueError(f"q {tuple(q.shape)} and keys {tuple(keys.shape)} disagree on "
                             "the head dimension")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
        if self.prefill_len is not None and prefill_len != self.prefill_len:
            raise ValueError(f"layer {self.layers} has {prefill_len} prompt keys, layer 0 "
                             f"{self.prefill_len}")
        m = min(self.size, prefill_len)
        if t < m or t > prefill_len:
            raise ValueError(f"q has {t} prompt queries; the window needs the last {m} of "
                             f"a {prefill_len}-token prompt")
        self.prefill_len, self.queries = prefill_len, m
        self._sums.append(self._window_sum(q[:, t - m:], keys))
        self.seconds += time.perf_counter() - start

    def _window_sum(self, q: Tensor, keys: Tensor) -> Tensor:
        """``[heads, L0]``: per query head, the sum of the window queries' causal rows."""
        heads, m, d = q.shape
        kv_heads, prefill_len, _ = keys.shape
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        qg = q.to(wide).reshape(kv_heads, heads // kv_heads, m, d)
        logits = torch.matmul(qg, keys.to(wide).transpose(-1, -2)[:, None])  # [kv, g, m, L0]
        logits = logits * (self.scale if self.scale is not None else 1.0 / math.sqrt(d))
        # Window query i sits at position L0 - m + i and sees the keys 0 ... L0 - m + i.
        seen = torch.arange(prefill_len, device=q.device)[None, :] <= \
            torch.arange(prefill_len - m, prefill_len, device=q.device)[:, None]
        logits = logits.masked_fill(~seen, float("-inf"))
        return torch.softmax(logits, dim=-1).sum(dim=-2).reshape(heads, prefill_len)

    def pool(self, layer: int, weights: Tensor) -> Tensor:
        """Step 1's weights ``[heads, L0 + 1]`` of ``layer`` (the first decode query's)
        made the mean over the window's queries and it, per head (see the class)."""
        if layer >= self.layers:
            raise ValueError(f"the observation window has {self.layers} layers (fill it "
                             f"during prefill: add(q, keys) per layer); this is layer {layer}")
        sums = self._sums[layer]
        if weights.dim() != 2 or weights.shape[0] != sums.shape[0] or \
                weights.shape[1] != sums.shape[1] + 1:
            raise ValueError(f"the observation window pools step 1 of a {self.prefill_len}"
                             f"-token prompt ([{sums.shape[0]}, {sums.shape[1] + 1}] "
                             f"weights); got {tuple(weights.shape)}")
        if self.queries == 0:
            return weights
        wide = torch.float64 if torch.float64 in (weights.dtype, sums.dtype) else torch.float32
        pooled = weights.to(wide).clone()
        pooled[:, :-1] += sums.to(wide)
        return pooled / (self.queries + 1)


class StepScores:
    """The scores of one decode step, gathered layer by layer as the model runs.

    ``add(q, keys, values)`` once per layer, in the order the model runs them (or
    ``add_weights(weights)`` where the model has its attention weights); then
    :meth:`report` is what ``SequenceBatch.step`` takes for the sequence: ``[layers,
    tokens]`` float32, or, when ``fold_weights`` are given (a folded sequence), the one
    folded row ``sum_l w_l * row_l`` accumulated in float64 as the layers come in (the
    per-layer rows are then never kept). A batch (``q [batch, heads, d]``) gives one report
    per sequence: ``report(i)``, trimmed to its length.

    ``head_sum=True`` (a tensor-parallel rank): rows are the rank's heads' sums, and the
    batch that sends them carries the head count (``client.batch(head_count=...)``).
    ``seconds`` is the host time spent in this object (capture cost; on CUDA it does not
    wait for the device).

    ``window`` (decode step 1 only, unbatched): an :class:`ObservationWindow` filled during
    prefill; each layer's weights are pooled with the window's before the scorer and the
    fold (the window is read, not changed).
    """

    def __init__(self, *, scorer: str = "attention",
                 fold_weights: Optional[Union[FoldWeights, Sequence[float]]] = None,
                 head_sum: bool = False, scale: Optional[float] = None,
                 window: Optional[ObservationWindow] = None) -> None:
        if window is not None and not isinstance(window, ObservationWindow):
            raise ValueError(f"window must be an ObservationWindow, not "
                             f"{type(window).__name__}")
        self.window = window
        if scorer not in SCORERS:
            raise ValueError(f"unknown scorer {scorer!r}; use one of {SCORERS}")
        if head_sum and scorer == "entropy":
            raise ValueError("scorer='entropy' cannot be taken from one rank's head sum")
        self.scorer = scorer
        self.head_sum = head_sum
        self.scale = scale
        self._weights: Optional[Tuple[float, ...]] = None
        if fold_weights is not None:
            self._weights = tuple(float(w) for w in (
                fold_weights.layer_weights if isinstance(fold_weights, FoldWeights)
                else fold_weights))
        self._rows: List[Tensor] = []
        self._folded: Optional[Tensor] = None
        self._lengths: Optional[List[int]] = None
        self._batched: Optional[bool] = None
        self.layers = 0
        self.heads = 0
        self.seconds = 0.0

    @property
    def folded(self) -> bool:
        return self._weights is not None

    def add(self, q: Tensor, keys: Tensor, values: Optional[Tensor] = None, *,
            lengths: Optional[Any] = None) -> None:
        """Adds the next layer from its queries and keys (see :func:`attention_row`)."""
        start = time.perf_counter()
        weights = attention_weights(q, keys, lengths=lengths, scale=self.scale)
        self._add_weights(weights, values, lengths)
        self.seconds += time.perf_counter() - start

    def add_weights(self, weights: Tensor, values: Optional[Tensor] = None, *,
                    lengths: Optional[Any] = None) -> None:
        """Adds the next layer from attention weights ``[heads, n]`` (batched ``[batch,
        heads, n]``) the model computed anyway (see :func:`pool_weights`)."""
        start = time.perf_counter()
        self._add_weights(weights, values, lengths)
        self.seconds += time.perf_counter() - start

    def _add_weights(self, weights: Tensor, values: Optional[Tensor],
                     lengths: Optional[Any]) -> None:
        batched = weights.dim() == 3
        if self._batched is None:
            self._batched = batched
            if lengths is not None:
                self._lengths = [int(x) for x in torch.as_tensor(lengths).reshape(-1)]
        elif self._batched != batched:
            raise ValueError("every layer of a step must be batched alike")
        if self.window is not None:
            if batched:
                raise ValueError("an observation window pools one sequence's step 1; "
                                 "capture a batched step without one")
            weights = self.window.pool(self.layers, weights)
        pooled = pool_weights(weights, values=values, scorer=self.scorer, lengths=lengths,
                              head_sum=self.head_sum)
        if self.head_sum:
            row, heads = pooled  # type: ignore[misc]
            if self.layers and heads != self.heads:
                raise ValueError(f"layer {self.layers} has {heads} heads, layer 0 "
                                 f"{self.heads}")
            self.heads = heads
        else:
            row = pooled
            self.heads = weights.shape[-2]
        if self._weights is not None:
            if self.layers >= len(self._weights):
                raise ValueError(f"the fold weights cover {len(self._weights)} layers; "
                                 f"this is layer {self.layers}")
            wide = torch.float32 if row.device.type == "mps" else torch.float64
            term = row.to(wide) * self._weights[self.layers]
            self._folded = term if self._folded is None else self._folded + term
        else:
            self._rows.append(row.float())
        self.layers += 1

    def rows(self) -> Tensor:
        """``[layers, n]`` (batched ``[batch, layers, n]``) float32 of a per-layer capture."""
        if self._weights is not None:
            raise ValueError("a folded capture keeps no per-layer rows: use report()")
        if not self._rows:
            raise ValueError("no layer was added")
        return torch.stack(self._rows, dim=-2)

    def folded_row(self) -> Tensor:
        """``[n]`` (batched ``[batch, n]``) float32: the folded row."""
        if self._weights is None:
            raise ValueError("not a folded capture (give fold_weights)")
        if self.layers != len(self._weights):
            raise ValueError(f"{self.layers} layers were added, the fold weights cover "
                             f"{len(self._weights)}")
        return self._folded.to(torch.float32)  # type: ignore[union-attr]

    def report(self, index: Optional[int] = None) -> Tensor:
        """What ``SequenceBatch.step`` takes for one sequence: ``[layers, tokens]``, or
        the folded ``[tokens]``. ``index``: the sequence's row of a batched capture
        (required then), trimmed to its length."""
        start = time.perf_counter()
        data = self.folded_row() if self._weights is not None else self.rows()
        if self._batched:
            if index is None:
                raise ValueError("a batched capture has one report per sequence: "
                                 "report(index)")
            data = data[index]
            if self._lengths is not None:
                data = data[..., :self._lengths[index]]
        elif index not in (None, 0):
            raise ValueError("an unbatched capture has one report")
        self.seconds += time.perf_counter() - start
        return data
