"""kvcache_client.torch: the worker side of kvcached in torch.

What a model worker needs around the client (docs/PYTHON.md, "The torch worker side"):

* **score capture**: :func:`attention_row` turns one decode step of one layer (the new
  token's query and the layer's keys) into the row kvcached takes (SPEC.md "Terms": the
  softmax attention of the newest token over the cache plus itself, mean-pooled over the
  query heads, every GQA query head counting once), or, for a tensor-parallel rank, its
  heads' sum and count; batched over sequences of different lengths; with the paper's
  order-preserving scorer variants (``"vnorm"``, ``"entropy"``). :class:`StepScores`
  gathers a step's layers and gives the report: ``[layers, tokens]``, or the one folded
  row of a folded sequence (SPEC.md "Folded reports"). :class:`ObservationWindow`, filled
  during prefill, makes step 1's rows pool the prompt's last queries' attention too.
* **KV caches** that apply the daemon's decisions: :class:`DenseKvCache` (per-layer
  tensors the worker owns) and :class:`PooledKvCache` (the daemon's KV pool, host shared
  memory or, with a CUDA engine, the GPU's memory opened by IPC handle, mapped by
  :class:`KvPoolMapping`, addressed through the daemon's slot table).
* **a decode loop** (:class:`DecodeLoop`) that follows ``next_needs_scores``: no capture
  on the steps that need no scores; ``submit``/``complete`` keep a step in flight, and
  :class:`MicroBatchedDecode` alternates micro-batches, each computed while the other's
  step travels.

Modules: ``capture`` (the scores), ``caches`` (the two KV caches), ``loop`` (the decode
loop); import the names from here. The rest of ``kvcache_client`` does not import this
package, so the client works without torch. Importing it without torch raises ImportError.

Shapes (``d`` the head dimension; GQA: query head ``h`` reads KV head ``h // (heads //
kv_heads)``, the grouping of Llama's ``repeat_kv``):

    q       [heads, d]             or [batch, heads, d]            the new token's queries
    keys    [kv_heads, n, d]       or [batch, kv_heads, n, d]      the cache AND the new
    values  like keys                                              token's key (last valid)

``n`` counts the cached tokens plus the new one (``tokens`` of the TrackedSequence). A
batch pads shorter sequences at the end and says their ``lengths``. Rows come back as
float32 on the inputs' device, the softmax taken in float32 (float64 inputs: float64).

Not thread-safe: captures, caches and loops belong to one worker thread.
"""

try:
    import torch as _torch  # noqa: F401  (checked here once, before any module needs it)
except ImportError as _error:  # pragma: no cover - exercised where torch is absent
    raise ImportError("kvcache_client.torch needs torch (Debian: python3-torch; or pip "
                      "install torch); the rest of kvcache_client works without it") \
        from _error

from .caches import DenseKvCache, KvCache, KvPoolMapping, PooledKvCache
from .capture import (SCORERS, ObservationWindow, StepScores, attention_row,
                      attention_weights, pool_weights)
from .loop import DecodeLoop, MicroBatchedDecode, MicroBatchTurn, PendingStep

__all__ = ["SCORERS", "DecodeLoop", "DenseKvCache", "KvCache", "KvPoolMapping",
           "MicroBatchTurn", "MicroBatchedDecode", "ObservationWindow", "PendingStep",
           "PooledKvCache", "StepScores", "attention_row", "attention_weights",
           "pool_weights"]
