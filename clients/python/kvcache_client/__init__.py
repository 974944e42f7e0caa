"""kvcache_client: the Python client of kvcached, the KV-cache eviction daemon.

    from kvcache_client import KvCacheClient

    with KvCacheClient("127.0.0.1:50051") as client, client.batch() as batch:
        batch.open("req-1", prefill_len=812, compression_ratio=0.9)
        decisions = batch.step({"req-1": layer_scores})   # once per decode step
        evicted = decisions["req-1"].raise_for_status().evicted

See docs/PYTHON.md. Needs grpcio and the generated kvcache.v1 modules on the path.

Everything a worker calls is importable from here (``__all__``), by what it is for:

* connecting: :class:`KvCacheClient`, :class:`TlsConfig`
* stepping: :class:`SequenceBatch` (one per rank; tracks each :class:`TrackedSequence`),
  or the raw :class:`StepStream` of :class:`Report`; a step not waited for is a
  :class:`StepFuture`
* policies and budgets: :class:`Policy`, ``PRESETS``, ``SCORING_PRESETS``,
  :func:`budget_tokens`
* results: :class:`Decision`, :class:`SequenceState`, :class:`SequenceStats`,
  :class:`KvPool`, :class:`KvChange`, :class:`CreatedScoreRegion`,
  :class:`ImportedSequence` (a hand-off between daemons: docs/DISAGGREGATION.md)
* errors: :class:`KvCacheError`, :class:`StepError`, :class:`ScoreShapeError`,
  :class:`SequenceInFlightError`
* scores: :class:`ScoreRegion` (the shared-memory transport, or a daemon's GPU memory
  through ``cuda_runtime``, loaded only then), :class:`FoldWeights` and
  :func:`fold_scores`, :func:`encode_scores` / :func:`prepare_scores` /
  :func:`decode_scores`
* torch workers: the subpackage ``kvcache_client.torch`` (needs torch; not imported here)

The rest is transport machinery: ``_proto`` (the generated messages), ``_arrays`` (numpy
and torch packing), ``masks`` (decision masks behind :class:`Decision`), and the helpers
of the modules above that are not in their ``__all__``.
"""

from .batch import SequenceBatch, TrackedSequence
from .budget import budget_tokens
from .client import KvCacheClient
from .credentials import TlsConfig
from .errors import KvCacheError, ScoreShapeError, SequenceInFlightError, StepError
from .fold import FoldWeights, fold_scores
from .policy import PRESETS, SCORING_PRESETS, Policy
from .region import ScoreRegion
from .results import (CreatedScoreRegion, Decision, ImportedSequence, KvChange, KvPool,
                      SequenceState, SequenceStats)
from .scores import (EncodedScores, PreparedScores, Scores, decode_scores, encode_scores,
                     prepare_scores)
from .stream import Report, StepFuture, StepStream

__all__ = [
    # connecting
    "KvCacheClient", "TlsConfig",
    # stepping
    "SequenceBatch", "TrackedSequence", "StepFuture", "StepStream", "Report",
    # policies and budgets
    "Policy", "PRESETS", "SCORING_PRESETS", "budget_tokens",
    # results
    "Decision", "SequenceState", "SequenceStats", "KvPool", "KvChange", "CreatedScoreRegion",
    "ImportedSequence",
    # errors
    "KvCacheError", "StepError", "ScoreShapeError", "SequenceInFlightError",
    # scores
    "ScoreRegion", "FoldWeights", "fold_scores", "Scores", "EncodedScores", "PreparedScores",
    "encode_scores", "prepare_scores", "decode_scores",
]
__version__ = "0.1.0"
