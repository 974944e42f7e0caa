"""The golden vectors of tests/data/golden (SPEC.md "Trace files"), those of span pooling
(tests/data/golden_span_pool, SPEC.md "Span pooling") and a replay through a SequenceBatch."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from daemon import REPO_ROOT
from kvcache_client import Policy, SequenceBatch

GOLDEN_DIR = REPO_ROOT / "tests" / "data" / "golden"
NAMES = sorted(p.name[:-len(".trace.jsonl")] for p in GOLDEN_DIR.glob("*.trace.jsonl"))
SPAN_POOL_DIR = REPO_ROOT / "tests" / "data" / "golden_span_pool"
SPAN_POOL_NAMES = sorted(p.name[:-len(".trace.jsonl")]
                         for p in SPAN_POOL_DIR.glob("*.trace.jsonl"))
FIELDS = ("step", "evicted", "cache_size", "next_needs_scores")


@dataclass
class Trace:
    name: str
    header: Dict[str, Any]
    steps: List[Dict[str, Any]]      # {"step": t, "layers": [[...], ...]?}
    expected: List[Dict[str, Any]]   # the golden decisions, FIELDS only

    def open_options(self) -> Dict[str, Any]:
        """Keyword arguments of open_sequence / SequenceBatch.open for this trace."""
        options: Dict[str, Any] = {"prefill_len": self.header["prefill_len"],
                                   "policy": Policy.from_dict(self.header["policy"])}
        for key in ("budget_tokens", "compression_ratio"):
            if key in self.header:
                options[key] = self.header[key]
        return options


def _lines(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load(name: str, directory: Path = GOLDEN_DIR) -> Trace:
    trace = _lines(directory / f"{name}.trace.jsonl")
    decisions = _lines(directory / f"{name}.decisions.jsonl")
    assert trace[0]["format"] == "kvtrace/1"
    return Trace(name, trace[0], trace[1:], [{k: d[k] for k in FIELDS} for d in decisions])


def as_dict(decision) -> Dict[str, Any]:
    return {k: getattr(decision, k) for k in FIELDS}


Encoder = Callable[[List[List[float]], int], Any]  # (layers, step index) -> scores for step()


def plain(layers: List[List[float]], index: int) -> Any:
    return layers


def replay(batch: SequenceBatch, traces: Dict[str, Trace], encode: Encoder = plain,
           **step_options: Any) -> Dict[str, List[Dict[str, Any]]]:
    """Steps every sequence id -> trace through ``batch`` (which holds them already), all
    together, those whose trace has ended dropping out; returns the decisions by id."""
    got: Dict[str, List[Dict[str, Any]]] = {sid: [] for sid in traces}
    for index in range(max(len(t.steps) for t in traces.values())):
        scores: Dict[str, Any] = {}
        for sid, trace in traces.items():
            if index < len(trace.steps):
                layers = trace.steps[index].get("layers")
                scores[sid] = None if layers is None else encode(layers, index)
        for sid, decision in batch.step(scores, **step_options).items():
            got[sid].append(as_dict(decision.raise_for_status()))
    return got


def quantize(layers: List[List[float]], dtype: str) -> List[List[float]]:
    """The values as the daemon sees them after a float16 / bfloat16 round trip."""
    if dtype == "float16":
        return [list(struct.unpack(f"<{len(r)}e", struct.pack(f"<{len(r)}e", *r)))
                for r in layers]
    from kvcache_client import decode_scores, encode_scores
    return [decode_scores(encode_scores([r], dtype="bfloat16").data, "bfloat16")
            for r in layers]


def scale(layers: Optional[List[List[float]]], factor: float) -> Optional[List[List[float]]]:
    return None if layers is None else [[v * factor for v in row] for row in layers]
