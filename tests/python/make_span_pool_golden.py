#!/usr/bin/env python3
"""Writes the golden vectors of span pooling (SPEC.md "Span pooling") into
tests/data/golden_span_pool/: for each case a kvtrace/1 trace of random rows and the
decisions of the float64 model (momentum64.PerLayerMomentum.decide), in the format of
tests/data/golden (SPEC.md "Trace files").

Scores are float32 values (written as the shortest decimal of the double that holds them
exactly), so that the engine reads exactly what the model pools. A case is drawn again
from the next seed until every step's margin (the relative gap between an evicted and a
kept eligible token of different momentum) is at least MIN_MARGIN: far from ties, so a
correct float32 engine reproduces the decisions exactly. Equal momenta (neighbours that
pooled the same maximum every step) are exact in float32 too and go to the lower position.

    /usr/bin/python3 tests/python/make_span_pool_golden.py [OUT_DIR]
"""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))

from golden import Trace  # noqa: E402
from momentum64 import PerLayerMomentum  # noqa: E402

MIN_MARGIN = 1e-3
OUT_DIR = Path(__file__).resolve().parents[1] / "data" / "golden_span_pool"

# name: (header without "format", layers per scoring step, decode steps, needle or None)
# A needle (first, length): a span of the prefill of which only the first token is ever
# attended; the generator asserts that span pooling keeps all of it.
CASES: Dict[str, Tuple[Dict[str, Any], int, int, Optional[Tuple[int, int]]]] = {
    "ema_every_step_k3": ({"prefill_len": 48, "budget_tokens": 16, "policy": {
        "aggregation": "ema", "alpha": 0.8, "refresh": "every_step", "span_pool": 3}},
        3, 20, None),
    "ema_lazy4_k7": ({"prefill_len": 64, "budget_tokens": 20, "policy": {
        "aggregation": "ema", "alpha": 0.8, "refresh": "lazy", "refresh_interval": 4,
        "span_pool": 7}}, 2, 21, None),
    "score_free_k7": ({"prefill_len": 80, "compression_ratio": 0.8, "policy": {
        "aggregation": "ema", "alpha": 0.8, "refresh": "score_free", "span_pool": 7}},
        4, 16, None),
    "cumulative_k15": ({"prefill_len": 96, "compression_ratio": 0.75, "policy": {
        "aggregation": "cumulative", "refresh": "every_step", "protect_recent": 4,
        "span_pool": 15}}, 2, 20, None),
    "single_step_k3": ({"prefill_len": 40, "budget_tokens": 12, "policy": {
        "aggregation": "single_step", "refresh": "every_step", "protect_sinks": 2,
        "span_pool": 3}}, 3, 18, None),
    "inertia_preset_k7": ({"prefill_len": 50, "budget_tokens": 18, "policy": {
        "preset": "inertia", "span_pool": 7}}, 2, 16, None),
    "needle_k9": ({"prefill_len": 60, "budget_tokens": 14, "policy": {
        "aggregation": "ema", "alpha": 0.8, "refresh": "every_step", "span_pool": 9}},
        1, 16, (20, 5)),
}

# The inertia preset's fields, for the model (the engine expands the preset itself).
PRESETS = {"inertia": {"aggregation": "ema", "alpha": 0.8, "refresh": "every_step"}}


def f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def model_header(header: Dict[str, Any]) -> Dict[str, Any]:
    policy = dict(header["policy"])
    if "preset" in policy:
        policy = {**PRESETS[policy.pop("preset")], **policy}
    return {**header, "policy": policy}


def random_rows(rng: random.Random, layers: int, cache: List[int],
                needle: Optional[Tuple[int, int]]) -> List[List[float]]:
    """Attention-like rows: a few heavy hitters over a light background. A needle's span
    is background but for its first token, which every row attends."""
    rows = []
    for _ in range(layers):
        row = [f32(rng.random() ** 3) for _ in cache]
        if needle is not None:
            first, length = needle
            for i, p in enumerate(cache):
                if first < p < first + length:
                    row[i] = f32(0.01 * rng.random())
                elif p == first:
                    row[i] = f32(2.0 + rng.random())
        rows.append(row)
    return rows


def draw(name: str, seed: int) -> Optional[Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]]:
    """(trace lines, decisions) of case `name` from `seed`, or None when some margin is
    below MIN_MARGIN or a needle was cut."""
    header, layers, steps, needle = CASES[name]
    rng = random.Random(seed)
    trace = [{"format": "kvtrace/1", **header}]
    model = PerLayerMomentum(Trace(name, model_header(header), [], []))
    decisions = []
    for step in range(1, steps + 1):
        line: Dict[str, Any] = {"step": step}
        rows = None
        if model.scoring(step):
            rows = random_rows(rng, layers, model.cache + [model.prefill + step - 1], needle)
            line["layers"] = rows
        decision, margin = model.decide(step, rows)
        if margin < MIN_MARGIN:
            return None
        trace.append(line)
        decisions.append(decision)
    if needle is not None and not set(range(needle[0], sum(needle))) <= set(model.cache):
        return None
    return trace, decisions


def write(out: Path, name: str) -> int:
    for seed in range(1, 1000):
        drawn = draw(name, seed)
        if drawn is not None:
            trace, decisions = drawn
            dump = lambda lines: "".join(json.dumps(x, separators=(",", ":")) + "\n"
                                         for x in lines)
            (out / f"{name}.trace.jsonl").write_text(dump(trace))
            (out / f"{name}.decisions.jsonl").write_text(dump(decisions))
            return seed
    raise SystemExit(f"{name}: no seed below 1000 gives margins >= {MIN_MARGIN}")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        print(f"{name}: seed {write(out, name)}")


if __name__ == "__main__":
    main()
