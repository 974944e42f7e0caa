#!/usr/bin/env python3
"""Writes the bundled demo trace (clients/replay/demo/demo.trace.jsonl): kvtrace/1 with
layer scores on every step, so that any policy can replay it.

The attention model: every position has a latent importance (a few heavy hitters, a
long tail), each decode step attends to it with noise and a mild recency bias, and each
layer sees a differently noised copy. The scores of a step cover the cache of the policy
that produced the trace (inertia), in ascending position order, as SPEC.md requires; other
policies replaying it see the same rows over their own caches.

Deterministic: the same file for the same arguments, on any machine. The budget comes
from the Python client (kvcache_client.budget_tokens, SPEC.md's rule), found in the source
tree beside this script (clients/python, and build/python for its generated modules).
"""
import argparse
import json
import random
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _path in (_ROOT / "clients" / "python", _ROOT / "build" / "python"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

from kvcache_client import budget_tokens  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="clients/replay/demo/demo.trace.jsonl")
    a = ap.parse_args()

    rng = random.Random(a.seed)
    total = a.prefill + a.steps
    importance = [rng.paretovariate(1.2) if rng.random() < 0.08 else rng.random() * 0.2
                  for _ in range(total)]
    for sink in range(4):  # attention sinks: the first tokens draw attention throughout
        importance[sink] = 25.0
    budget = budget_tokens(a.prefill, a.ratio)

    cache = list(range(a.prefill))
    momentum = {p: 0.0 for p in cache}
    header = {"format": "kvtrace/1", "prefill_len": a.prefill, "compression_ratio": a.ratio,
              "policy": {"aggregation": "ema", "alpha": 0.8, "refresh": "every_step"}}
    with open(a.out, "w") as out:
        out.write(json.dumps(header, separators=(",", ":")) + "\n")
        for step in range(1, a.steps + 1):
            new = a.prefill + step - 1
            cache.append(new)
            momentum[new] = 0.0
            layers = []
            for _ in range(a.layers):
                raw = [importance[p] * rng.lognormvariate(0, 0.6) * (1 + 2.0 * (p >= new - 8))
                       for p in cache]
                z = sum(raw)
                layers.append([round(v / z, 7) for v in raw])
            for row in layers:  # the producing policy's own EMA, to pick its cache
                for i, p in enumerate(cache):
                    momentum[p] = 0.8 * momentum[p] + 0.2 * row[i]
            while len(cache) > budget:
                victim = min(cache, key=lambda p: (momentum[p], p))
                cache.remove(victim)
            out.write(json.dumps({"step": step, "layers": layers}, separators=(",", ":")) + "\n")
    print(f"wrote {a.out}: prefill {a.prefill}, {a.steps} steps, {a.layers} layers, budget {budget}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
