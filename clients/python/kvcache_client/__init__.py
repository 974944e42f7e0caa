"""kvcache_client: the Python client of kvcached, the KV-cache eviction daemon.

    from kvcache_client import KvCacheClient

    with KvCacheClient("127.0.0.1:50051") as client, client.batch() as batch:
        batch.open("req-1", prefill_len=812, compression_ratio=0.9)
        decisions = batch.step({"req-1": layer_scores})   # once per decode step
        evicted = decisions["req-1"].raise_for_status().evicted

See docs/PYTHON.md. Needs grpcio and the generated kvcache.v1 modules on the path.
"""

from .batch import SequenceBatch, TrackedSequence
from .client import KvCacheClient
from .credentials import TlsConfig
from .errors import KvCacheError, StepError
from .fold import FoldWeights, fold_scores
from .policy import PRESETS, Policy
from .region import ScoreRegion
from .results import CreatedScoreRegion, Decision, KvChange, KvPool, SequenceState, SequenceStats
from .scores import (EncodedScores, PreparedScores, Scores, ScoreShapeError, decode_scores,
                     encode_scores, prepare_scores)
from .stream import Report, StepStream

__all__ = [
    "CreatedScoreRegion", "Decision", "EncodedScores", "FoldWeights", "KvCacheClient", "KvCacheError", "KvChange",
    "KvPool", "PRESETS", "Policy", "PreparedScores",
    "Report", "ScoreRegion", "Scores", "ScoreShapeError", "SequenceBatch", "SequenceState",
    "SequenceStats", "StepError", "StepStream", "TlsConfig", "TrackedSequence", "decode_scores",
    "encode_scores", "fold_scores", "prepare_scores",
]
__version__ = "0.1.0"
