"""kvcache-eval: the paper's claims measured on the decoder trained here, through a real
kvcached.

    eval/kvcache-eval            # writes docs/EVALUATION.md and docs/img/eval_*.png

Starts its own kvcached (build/bin/kvcached, or --kvcached / $KVCM_KVCACHED) with host
shared-memory KV pools shaped like the decoder's cache and shared-memory score regions;
the decoder's K/V live in the daemon's pool, scores are folded and go through a score
region. Then:

1. the task set (--per_task samples of each task, contexts --lengths) under the full cache
   and every preset at compression 0.5, 0.8 and 0.9: accuracy per task and overall,
   retained tokens, decode tokens/s, the share of decode time spent capturing scores and
   in the daemon round trip;
2. ablations at --ablation_ratio: VNorm and entropy scorers against plain attention
   (accuracy, Jaccard overlap of the cached sets, under EMA and under single-step scoring),
   alpha in {0, 0.5, 0.8, 0.9, 0.95}, Lazy r in {1, 2, 4, 8} and Score-Free, and the
   relevance-shift task (the question changes mid-generation);
3. throughput at the longest context: full cache, full refresh, Lazy4 and Score-Free,
   end to end, with where the time goes;
4. the first step composed with prefill-time selection: inertia, Lazy4 and Score-Free,
   each plain, with an observation window (--window: step 1 pools the prompt's last w
   queries' attention, kvcache_client.torch.ObservationWindow), with span pooling
   (--span_pool: the daemon max-pools every row over k positions) and with both, at every
   compression ratio, on the first --composed_per_task samples of each task, and in the
   relevance-shift task; every difference with a paired bootstrap interval
   (kvcache_eval/bootstrap.py); before it a small sweep of w and k (--sweep_per_task
   samples of a set of its own, full generations at --ablation_ratio).

With --handoff, also (not by default) the disaggregated hand-off of
docs/DISAGGREGATION.md: two daemons on loopback with the same pools; each generation decides
step 1 on the first (the prefill node's), is imported by the second (ImportSequence) and
decodes on there. Checks that every generation is token for token the one a single daemon
produces, and reports the bytes moved against the prefill's whole K/V.

Prints every table as it goes and writes them, with the plots, to --out and --img.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from kvcache_client import KvCacheClient, Policy
from kvcache_client.policy import PRESETS  # the one list: cache_manager/policy/presets.txt
from kvcache_client.torch import KvPoolMapping

from . import bootstrap, diagnostics, report, tasks
from .first_step import composed_policy, first_step_gain
from .daemon import REPO_ROOT, Kvcached, pool_flags, scrape
from .model import load
from .runner import Outcome, Prefilled, RunConfig, Runner, jaccard, prefill

HANDOFF_PRESETS = ("inertia", "inertia_lazy4", "score_free", "tova", "h2o", "streaming_llm",
                   "random")

DEFAULT_WEIGHTS = Path(__file__).resolve().parents[1] / "weights" / "decoder.pt"
RATIOS = (0.5, 0.8, 0.9)
ALPHAS = (0.0, 0.5, 0.8, 0.9, 0.95)
LAZY = (1, 2, 4, 8)

#: The first step composed with prefill-time selection: which presets, which variants (an
#: observation window, span pooling), the sweep's grid.
COMPOSED_PRESETS = ("inertia", "inertia_lazy4", "score_free")
VARIANTS = ("plain", "window", "span", "both")
VARIANT_SUFFIX = {"plain": "", "window": "+window", "span": "+span", "both": "+window+span"}
#: Chosen with the sweep (docs/EVALUATION.md shows this run's): the defaults of --window
#: and --span_pool.
WINDOW, SPAN_POOL = 4, 7
SWEEP_WINDOWS = (0, 2, 4, 8, 16)
SWEEP_SPANS = (0, 3, 5, 7, 9)


def main_configs(ratios: Sequence[float] = RATIOS,
                 presets: Sequence[str] = PRESETS) -> List[RunConfig]:
    out = [RunConfig("full", None)]
    for ratio in ratios:
        out += [RunConfig(f"{p}@{ratio}", p, ratio) for p in presets]
    return out


def ablation_configs(ratio: float) -> List[RunConfig]:
    out = []
    for scorer in ("attention", "vnorm", "entropy"):
        out.append(RunConfig(f"ema-{scorer}@{ratio}", "inertia", ratio, scorer=scorer,
                             track_sets=True))
        out.append(RunConfig(f"single-{scorer}@{ratio}", "tova", ratio, scorer=scorer,
                             track_sets=True))
    for alpha in ALPHAS:
        out.append(RunConfig(f"alpha{alpha}@{ratio}", Policy(aggregation="ema", alpha=alpha),
                             ratio))
    for r in LAZY:
        out.append(RunConfig(f"lazy{r}@{ratio}",
                             Policy(aggregation="ema", alpha=0.8, refresh="lazy",
                                    refresh_interval=r), ratio))
    out.append(RunConfig(f"score_free@{ratio}", "score_free", ratio))
    return out


def run_set(runner: Runner, model: Any, samples: Sequence[tasks.Sample],
            configs: Sequence[RunConfig], label: str) -> Dict[str, List[Outcome]]:
    """Every configuration on every sample (each sample prefilled once, filling the
    observation windows the configurations use)."""
    results: Dict[str, List[Outcome]] = {c.name: [] for c in configs}
    windows = sorted({c.window for c in configs if c.window})
    started = time.perf_counter()
    for index, sample in enumerate(samples):
        pre = prefill(model, sample, windows)
        for config in configs:
            results[config.name].append(runner.run(config, pre, index))
        if (index + 1) % max(1, len(samples) // 10) == 0:
            print(f"  {label}: {index + 1}/{len(samples)} samples, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    return results


def summarize(outcomes: Sequence[Outcome], field: str = "correct") -> Dict[str, Any]:
    by_task: Dict[str, List[bool]] = {}
    for o in outcomes:
        by_task.setdefault(o.task, []).append(getattr(o, field))
    steps = sum(o.steps for o in outcomes)
    decode = sum(o.decode_s for o in outcomes)
    return {
        "accuracy": sum(getattr(o, field) for o in outcomes) / len(outcomes),
        "by_task": {t: sum(v) / len(v) for t, v in by_task.items()},
        "retained": statistics.mean(o.retained for o in outcomes),
        "tokens_per_s": steps / decode if decode else 0.0,
        "capture_share": sum(o.capture_s for o in outcomes) / decode if decode else 0.0,
        "step_share": sum(o.step_s for o in outcomes) / decode if decode else 0.0,
        "scoring_share": (sum(o.scoring_steps for o in outcomes) / steps) if steps else 0.0,
        "evidence_kept": statistics.mean(o.evidence_kept for o in outcomes),
        "samples": len(outcomes),
    }


def throughput(runner: Runner, model: Any, length: int, new_tokens: int, repeats: int,
               seed: int, ratio: float) -> Dict[str, Any]:
    """Decode ``new_tokens`` after a ``length``-token prompt, end to end, per policy."""
    import random
    rng = random.Random(seed)
    samples = [tasks.make_sample("niah_multikey", rng, length) for _ in range(repeats)]
    configs = [
        RunConfig("full cache", None),
        RunConfig("inertia (full refresh)", "inertia", ratio),
        RunConfig("inertia_lazy4", "inertia_lazy4", ratio),
        RunConfig("score_free", "score_free", ratio),
        RunConfig("inertia, weights reused", "inertia", ratio, capture_from="weights"),
        RunConfig("inertia_lazy4, weights reused", "inertia_lazy4", ratio,
                  capture_from="weights"),
        RunConfig("inertia, per-layer inline, dense", "inertia", ratio, folded=False,
                  shm_scores=False, pooled=False),
        RunConfig("inertia_lazy4, per-layer inline, dense", "inertia_lazy4", ratio,
                  folded=False, shm_scores=False, pooled=False),
    ]
    rows: Dict[str, Dict[str, float]] = {c.name: {"steps": 0, "decode_s": 0.0, "capture_s": 0.0,
                                                  "step_s": 0.0, "apply_s": 0.0}
                                         for c in configs}
    for index, sample in enumerate(samples):
        sample.answer = [tasks.DOT] * (new_tokens + 1)  # decode new_tokens steps, whatever
        pre = prefill(model, sample)
        for config in configs:  # interleaved, so drifts of the machine hit all alike
            o = runner.run(config, pre, index)
            row = rows[config.name]
            for key in ("steps", "decode_s", "capture_s", "step_s", "apply_s"):
                row[key] += getattr(o, key)
    for row in rows.values():
        row["tokens_per_s"] = row["steps"] / row["decode_s"]
        row["model_s"] = row["decode_s"] - row["capture_s"] - row["step_s"] - row["apply_s"]
        for key in ("capture_s", "step_s", "apply_s", "model_s"):
            row[key.replace("_s", "_ms_per_token")] = 1000 * row[key] / row["steps"]
    return {"length": length, "new_tokens": new_tokens, "repeats": repeats, "ratio": ratio,
            "rows": rows}


def span_pool_supported(client: KvCacheClient) -> bool:
    """Whether the daemon span-pools: one that predates it drops the unknown Policy field
    (proto3) and pools nothing, so the resolved policy of a sequence is read back."""
    try:
        policy = Policy(preset="inertia", span_pool=3)
    except TypeError:  # a client without the field
        return False
    with client.batch() as batch:
        sid = "span-pool-probe"
        state = batch.open(sid, 8, budget_tokens=4, policy=policy)
        batch.close_sequence(sid)
    return getattr(state.policy, "span_pool", 0) == 3


def variant_name(preset: str, variant: str, ratio: float) -> str:
    return f"{preset}{VARIANT_SUFFIX[variant]}@{ratio}"


def composed_variants(span: int) -> Tuple[str, ...]:
    """The variants a run can measure: those with span pooling need a daemon that pools."""
    return VARIANTS if span > 1 else ("plain", "window")


def composed_configs(ratios: Sequence[float], window: int, span: int,
                     presets: Sequence[str] = COMPOSED_PRESETS) -> List[RunConfig]:
    """The full cache, then every preset in every variant at every ratio."""
    out = [RunConfig("full", None)]
    for ratio in ratios:
        for preset in presets:
            for variant in composed_variants(span):
                out.append(RunConfig(
                    variant_name(preset, variant, ratio),
                    composed_policy(preset, span if variant in ("span", "both") else 0),
                    ratio, window=window if variant in ("window", "both") else 0))
    return out


def sweep_configs(ratio: float, windows: Sequence[int], spans: Sequence[int]) -> List[RunConfig]:
    return [RunConfig(f"sweep-w{w}-k{k}@{ratio}", composed_policy("inertia", k), ratio,
                      window=w) for w in windows for k in spans]


def sweep(runner: Runner, model: Any, samples: Sequence[tasks.Sample], ratio: float,
          spans: Sequence[int]) -> Dict[str, Any]:
    """Inertia at ``ratio`` over the grid of window sizes and span widths: the evidence
    kept after step 1 and the accuracy, per (w, k)."""
    configs = sweep_configs(ratio, SWEEP_WINDOWS, spans)
    print(f"sweep: {len(samples)} samples x {len(configs)} configurations", flush=True)
    out = run_set(runner, model, samples, configs, "sweep")
    grid = {}
    for w in SWEEP_WINDOWS:
        for k in spans:
            v = out[f"sweep-w{w}-k{k}@{ratio}"]
            grid[f"{w},{k}"] = {
                "evidence_kept": statistics.mean(o.evidence_kept for o in v),
                "accuracy": sum(o.correct for o in v) / len(v),
                "first_token_kept": sum(o.first_token_kept for o in v) / len(v)}
    best = max(grid, key=lambda c: (grid[c]["evidence_kept"], grid[c]["accuracy"]))
    return {"ratio": ratio, "samples": len(samples), "windows": list(SWEEP_WINDOWS),
            "spans": list(spans), "grid": grid, "best": best}


def paired(treated: Sequence[Outcome], control: Sequence[Outcome],
           field: str) -> Dict[str, Any]:
    """The paired bootstrap interval of ``treated - control`` in ``field``."""
    interval = bootstrap.paired_difference([float(getattr(o, field)) for o in treated],
                                           [float(getattr(o, field)) for o in control])
    return asdict(interval)


def composed_comparisons(out: Dict[str, List[Outcome]], ratios: Sequence[float],
                         span: int) -> Dict[str, Any]:
    """Every variant against its plain preset (accuracy, evidence kept after step 1), and
    every configuration at the lowest ratio against the full cache (accuracy)."""
    against_plain: Dict[str, Any] = {}
    for ratio in ratios:
        for preset in COMPOSED_PRESETS:
            plain = out[variant_name(preset, "plain", ratio)]
            for variant in composed_variants(span)[1:]:
                other = out[variant_name(preset, variant, ratio)]
                against_plain[variant_name(preset, variant, ratio)] = {
                    "accuracy": paired(other, plain, "correct"),
                    "evidence_kept": paired(other, plain, "evidence_kept")}
    low = min(ratios)
    against_full = {name: paired(v, out["full"], "correct")
                    for name, v in out.items() if name.endswith(f"@{low}")}
    return {"against_plain": against_plain, "against_full": against_full, "full_ratio": low}


def composed(runner: Runner, model: Any, args: argparse.Namespace,
             samples: Sequence[tasks.Sample], span_ok: bool,
             reuse: Optional[Dict[str, List[Outcome]]] = None) -> Dict[str, Any]:
    """The section "The first step composed with prefill-time selection": the sweep, then
    the composed configurations on ``samples``. ``reuse``: outcomes on these samples that
    the main part measured already (the full cache, the plain presets), by name; decisions
    are deterministic, so running them again would give the same."""
    span = args.span_pool if span_ok else 0
    spans = SWEEP_SPANS if span_ok else (0,)
    swept = sweep(runner, model, tasks.eval_set(args.seed + 29, args.sweep_per_task,
                                                [int(x) for x in args.lengths.split(",")]),
                  args.ablation_ratio, spans) if args.sweep_per_task else None
    reuse = reuse or {}
    configs = [c for c in composed_configs(RATIOS, args.window, span) if c.name not in reuse]
    print(f"composed: {len(samples)} samples x {len(configs)} configurations (and "
          f"{len(reuse)} of the main part's)", flush=True)
    out = {**reuse, **run_set(runner, model, samples, configs, "composed")}
    runs = {}
    for name, v in out.items():
        runs[name] = summarize(v)
        runs[name]["first_token_kept"] = sum(o.first_token_kept for o in v) / len(v)
        kept = [o.correct for o, f in zip(v, out["full"])
                if f.correct and o.evidence_kept == 1.0]
        runs[name]["correct_if_kept"] = sum(kept) / len(kept) if kept else float("nan")
        runs[name]["kept_samples"] = len(kept)
    return {"window": args.window, "span_pool": span, "span_pool_asked": args.span_pool,
            "span_supported": span_ok, "variants": list(composed_variants(span)),
            "presets": list(COMPOSED_PRESETS), "ratios": list(RATIOS),
            "samples": len(samples), "sweep": swept, "runs": runs,
            "comparisons": composed_comparisons(out, RATIOS, span),
            "resamples": bootstrap.RESAMPLES, "bootstrap_seed": bootstrap.SEED}


def composed_samples(samples: Sequence[tasks.Sample], per_task: int) -> List[int]:
    """The indices of the first ``per_task`` samples of each task (of the main set)."""
    seen: Dict[str, int] = {}
    out = []
    for index, sample in enumerate(samples):
        if seen.get(sample.task, 0) < per_task:
            seen[sample.task] = seen.get(sample.task, 0) + 1
            out.append(index)
    return out


def shift_composed(out: Dict[str, List[Outcome]], ratios: Sequence[float],
                   span: int) -> Dict[str, Any]:
    """The relevance-shift runs of the composed configuration against their plain presets:
    the second question and both, paired intervals."""
    rows = {}
    for ratio in ratios:
        for preset in COMPOSED_PRESETS:
            plain = out[variant_name(preset, "plain", ratio)]
            name = variant_name(preset, "both" if span > 1 else "window", ratio)
            rows[name] = {"second": paired(out[name], plain, "last_correct"),
                          "both": paired(out[name], plain, "correct")}
    return rows


SHIFT_PRESETS = ("inertia", "inertia_lazy4", "score_free", "tova", "h2o", "streaming_llm")


def relevance_shift(runner: Runner, model: Any, args: argparse.Namespace,
                    lengths: Sequence[int], span_ok: bool) -> Dict[str, Any]:
    """The relevance-shift task: every shift preset, and the composed first step of
    inertia, Lazy4 and Score-Free (the window, with span pooling where the daemon does
    it), at each --shift_ratio."""
    ratios = [float(x) for x in args.shift_ratio.split(",")]
    shift = tasks.shift_set(args.seed + 7, args.per_task * 2, lengths, args.shift_gap)
    span = args.span_pool if span_ok else 0
    variant = "both" if span > 1 else "window"
    composed_too = "composed" not in set(filter(None, args.skip.split(",")))
    configs = [RunConfig("full", None)]
    for ratio in ratios:
        configs += [RunConfig(f"{p}@{ratio}", p, ratio) for p in SHIFT_PRESETS]
        if composed_too:
            configs += [RunConfig(variant_name(p, variant, ratio), composed_policy(p, span),
                                  ratio, window=args.window) for p in COMPOSED_PRESETS]
    print(f"shift: {len(shift)} samples x {len(configs)} configurations", flush=True)
    out = run_set(runner, model, shift, configs, "shift")
    return {
        "gap": args.shift_gap, "ratios": ratios,
        "runs": {name: {"second": summarize(v, "last_correct")["accuracy"],
                        "both": summarize(v)["accuracy"],
                        "first": sum(o.generated[:len(s.answer)] == s.answer
                                     for o, s in zip(v, shift)) / len(v)}
                 for name, v in out.items()},
        "composed": shift_composed(out, ratios, span) if composed_too else {},
        "composed_variant": variant}


DIAGNOSED = ("inertia", "inertia_lazy4", "h2o", "tova")


def eviction_diagnostics(model, args: argparse.Namespace, samples) -> Dict[str, Any]:
    """The eviction-quality figures of docs/METRICS.md on this model: live, from the /metrics
    of a kvcached of its own (--diagnostics_every 1, every sequence sampled, so the
    other parts' daemon pays nothing for them), and offline from the runs' step traces
    (kvcache_eval/diagnostics.py)."""
    cfg = model.cfg
    ratio = args.ablation_ratio
    print(f"diagnostics: {len(samples)} samples x {len(DIAGNOSED)} policies at {ratio}",
          flush=True)
    flags = [*pool_flags(cfg.layers, cfg.kv_heads, cfg.head_dim), "--diagnostics_every=1",
             "--diagnostics_sample=1"]
    traces = []
    with Kvcached(flags, binary=args.kvcached) as daemon, \
            KvCacheClient(daemon.address, timeout=60) as client, \
            KvPoolMapping.for_rank(client, 0) as mapping:
        runner = Runner(model, client, mapping, seed=args.seed)
        try:
            for index, sample in enumerate(samples):
                pre = prefill(model, sample)
                for policy in DIAGNOSED:
                    run = runner.run(RunConfig(f"{policy}-diag@{ratio}", policy, ratio,
                                               trace=True), pre, index)
                    traces.append(run.trace)
        finally:
            runner.close()
        live = diagnostics.live_figures(scrape(daemon.metrics_address))
    offline = diagnostics.offline_figures(traces)
    return {"ratio": ratio, "samples": len(samples), "gap": args.shift_gap,
            "live": {p: live.get(p, {}) for p in DIAGNOSED},
            "offline": {p: offline.get(p, {}) for p in DIAGNOSED}}


def handoff_configs(ratio: float) -> List[Tuple[RunConfig, RunConfig]]:
    """(single-daemon run, hand-off run) pairs: every preset with the K/V in the pools,
    and one with the K/V in the worker's own tensors (a DenseKvCache goes on as it is)."""
    pairs = [(RunConfig(f"{p}@{ratio}", p, ratio, track_sets=True),
              RunConfig(f"{p}@{ratio}-handoff", p, ratio, track_sets=True, handoff=True))
             for p in HANDOFF_PRESETS]
    pairs.append((RunConfig(f"inertia@{ratio}-dense", "inertia", ratio, pooled=False,
                            track_sets=True),
                  RunConfig(f"inertia@{ratio}-dense-handoff", "inertia", ratio, pooled=False,
                            track_sets=True, handoff=True)))
    return pairs


def handoff(model, args: argparse.Namespace, samples) -> Dict[str, Any]:
    """Each generation twice: on one daemon, and handed off after step 1 from a daemon A
    to a daemon B (both ours, same pools, on loopback). Per configuration: how many
    generations are identical (the same tokens, and the same cached positions after every
    step), and what the hand-off moved."""
    cfg = model.cfg
    ratio = args.ablation_ratio
    flags = pool_flags(cfg.layers, cfg.kv_heads, cfg.head_dim)
    if args.kv_transfer:
        flags.append(f"--kv_transfer={args.kv_transfer}")
    pairs = handoff_configs(ratio)
    print(f"handoff: {len(samples)} samples x {len(pairs)} configurations, two daemons",
          flush=True)
    runs: Dict[str, Dict[str, Any]] = {}
    with Kvcached(flags, binary=args.kvcached) as a, Kvcached(flags, binary=args.kvcached) as b, \
            KvCacheClient(a.address, timeout=60) as ca, \
            KvCacheClient(b.address, timeout=60) as cb, \
            KvPoolMapping.for_rank(ca, 0) as map_a, KvPoolMapping.for_rank(cb, 0) as map_b:
        runner = Runner(model, ca, map_a, seed=args.seed, peer=(cb, map_b))
        block_bytes = map_a.pool.block_bytes
        tpb = map_a.pool.tokens_per_block
        try:
            for index, sample in enumerate(samples):
                pre = prefill(model, sample)
                for single, moved in pairs:
                    one = runner.run(single, pre, index)
                    two = runner.run(moved, pre, index)
                    row = runs.setdefault(single.name, {
                        "samples": 0, "identical": 0, "kv_bytes": 0, "record_bytes": 0,
                        "prefill_kv_bytes": 0, "seconds": 0.0, "transport": set(),
                        "mismatches": []})
                    row["samples"] += 1
                    # The same tokens from the same cached sets after every step.
                    same = one.generated == two.generated and one.sets == two.sets
                    row["identical"] += same
                    if not same:
                        row["mismatches"].append(index)
                    if two.handoff is not None:
                        row["kv_bytes"] += two.handoff.kv_bytes
                        row["record_bytes"] += two.handoff.record_bytes
                        row["seconds"] += two.handoff.seconds
                        row["transport"].add(two.handoff.transport)
                    # What moving the whole prefill (L0 tokens' blocks) would have cost.
                    row["prefill_kv_bytes"] += -(-sample.length // tpb) * block_bytes
        finally:
            runner.close()
    for row in runs.values():
        n = row["samples"]
        row["transport"] = ",".join(sorted(row["transport"]))
        for key in ("kv_bytes", "record_bytes", "prefill_kv_bytes", "seconds"):
            row[key + "_mean"] = row.pop(key) / n
    return {"ratio": ratio, "samples": len(samples), "runs": runs,
            "identical": all(r["identical"] == r["samples"] for r in runs.values())}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvcache-eval", description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default=str(DEFAULT_WEIGHTS))
    parser.add_argument("--per_task", type=int, default=40, help="samples per task")
    parser.add_argument("--lengths", default="256,512,1024",
                        help="prompt lengths, spread over each task's samples")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ablation_ratio", type=float, default=0.9)
    parser.add_argument("--shift_ratio", default="0.5,0.8",
                        help="compression ratios of the relevance-shift task")
    parser.add_argument("--shift_gap", type=int, default=32,
                        help="filler tokens fed between the first answer and the new question")
    parser.add_argument("--throughput_tokens", type=int, default=256)
    parser.add_argument("--throughput_repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kvcached", default=None, help="the daemon binary")
    parser.add_argument("--out", default=str(REPO_ROOT / "docs" / "EVALUATION.md"))
    parser.add_argument("--img", default=str(REPO_ROOT / "docs" / "img"))
    parser.add_argument("--json", default=None, help="also write every number here")
    parser.add_argument("--handoff", action="store_true",
                        help="also run the disaggregated hand-off (two daemons, ImportSequence "
                        "after step 1): generations identical to one daemon's, bytes moved")
    parser.add_argument("--handoff_per_task", type=int, default=None,
                        help="samples per task of the hand-off part (default: per_task / 4)")
    parser.add_argument("--kv_transfer", default=None, choices=("ucx", "grpc"),
                        help="the hand-off daemons' --kv_transfer (default: theirs)")
    parser.add_argument("--window", type=int, default=WINDOW,
                        help="the composed configurations' observation window (prompt "
                        "queries pooled into step 1)")
    parser.add_argument("--span_pool", type=int, default=SPAN_POOL,
                        help="the composed configurations' span pooling width (odd, 3-255)")
    parser.add_argument("--composed_per_task", type=int, default=20,
                        help="samples per task of the composed section (the main set's first)")
    parser.add_argument("--sweep_per_task", type=int, default=4,
                        help="samples per task of the window/span sweep (0: no sweep)")
    parser.add_argument("--first_step_only", action="store_true",
                        help="only the composed first step's evidence kept at the ablation "
                        "ratio, plain against window + span pooling, on --per_task samples "
                        "per task: printed, no page written (seconds; the demo runs it)")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to skip: "
                        "main,composed,ablations,shift,diagnostics,throughput")
    return parser.parse_args(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    lengths = [int(x) for x in args.lengths.split(",")]
    model, meta = load(args.weights)
    cfg = model.cfg
    started = time.perf_counter()
    command = "eval/kvcache-eval " + " ".join(sys.argv[1:] if argv is None else argv)
    results: Dict[str, Any] = {
        "command": command.strip(), "weights": os.path.relpath(args.weights, REPO_ROOT),
        "train_meta": meta, "per_task": args.per_task, "lengths": lengths, "seed": args.seed,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{args.threads} threads",
        "model": asdict(cfg), "parameters": sum(p.numel() for p in model.parameters()),
        "wall": {},
    }
    # --stream_idle_timeout=0: the runner's inline batch waits idle through every part
    # before the throughput one (over an hour on a loaded machine); the default 10 min
    # would end its stream.
    with Kvcached([*pool_flags(cfg.layers, cfg.kv_heads, cfg.head_dim),
                   "--stream_idle_timeout=0"], binary=args.kvcached) as daemon, \
            KvCacheClient(daemon.address, timeout=60) as client, \
            KvPoolMapping.for_rank(client, 0) as mapping:
        runner = Runner(model, client, mapping, seed=args.seed)
        if args.first_step_only:
            try:
                span = args.span_pool if span_pool_supported(client) else 0
                print(first_step_gain(runner, model, args.seed, args.per_task, lengths,
                                      args.ablation_ratio, args.window, span).describe(),
                      flush=True)
            finally:
                runner.close()
            return 0
        try:
            samples = tasks.eval_set(args.seed, args.per_task, lengths)
            main_out: Dict[str, List[Outcome]] = {}
            if "main" not in skip:
                t = time.perf_counter()
                print(f"main: {len(samples)} samples x {len(main_configs())} configurations",
                      flush=True)
                out = main_out = run_set(runner, model, samples, main_configs(), "main")
                results["main"] = {name: summarize(v) for name, v in out.items()}
                full = out["full"]
                for name, v in out.items():  # do evictions of anything but evidence hurt?
                    kept = [o.correct for o, f in zip(v, full)
                            if f.correct and o.evidence_kept == 1.0]
                    results["main"][name]["correct_if_kept"] = (
                        sum(kept) / len(kept) if kept else float("nan"))
                    results["main"][name]["kept_samples"] = len(kept)
                results["wall"]["main"] = time.perf_counter() - t
                print(report.main_tables(results), flush=True)
            span_ok = span_pool_supported(client)
            if not span_ok:
                print("composed: this kvcached does not span-pool (Policy.span_pool is not "
                      "read back): the window alone", flush=True)
            if "composed" not in skip:
                t = time.perf_counter()
                chosen = composed_samples(samples, args.composed_per_task)
                plain = {c.name for c in composed_configs(RATIOS, 0, 0)}  # full and plain
                reuse = {name: [v[i] for i in chosen] for name, v in main_out.items()
                         if name in plain}
                results["composed"] = composed(runner, model, args,
                                               [samples[i] for i in chosen], span_ok, reuse)
                results["wall"]["composed"] = time.perf_counter() - t
                print(report.composed_tables(results), flush=True)
            if "ablations" not in skip:
                t = time.perf_counter()
                configs = ablation_configs(args.ablation_ratio)
                print(f"ablations: {len(samples)} samples x {len(configs)} configurations",
                      flush=True)
                out = run_set(runner, model, samples, configs, "ablations")
                ablations = {name: summarize(v) for name, v in out.items()}
                r = args.ablation_ratio
                pairs = {}
                for kind in ("ema", "single"):
                    base = out[f"{kind}-attention@{r}"]
                    for scorer in ("vnorm", "entropy"):
                        other = out[f"{kind}-{scorer}@{r}"]
                        pairs[f"{kind}-{scorer}"] = statistics.mean(
                            jaccard(a.sets, b.sets) for a, b in zip(base, other))
                    pairs[f"{kind}-vs-ema"] = statistics.mean(
                        jaccard(a.sets, b.sets) for a, b in zip(base, out[f"ema-attention@{r}"]))
                results["ablations"] = {"ratio": r, "runs": ablations, "jaccard": pairs}
                results["wall"]["ablations"] = time.perf_counter() - t
                print(report.ablation_tables(results), flush=True)
            if "shift" not in skip:
                t = time.perf_counter()
                results["shift"] = relevance_shift(runner, model, args, lengths, span_ok)
                results["wall"]["shift"] = time.perf_counter() - t
                print(report.shift_table(results), flush=True)
                if results["shift"]["composed"]:
                    print(report.composed_shift_table(results), flush=True)
            if "diagnostics" not in skip:
                t = time.perf_counter()
                results["diagnostics"] = eviction_diagnostics(
                    model, args, tasks.shift_set(args.seed + 13, args.per_task // 2, lengths,
                                                 args.shift_gap))
                results["wall"]["diagnostics"] = time.perf_counter() - t
                print(report.diagnostics_table(results), flush=True)
            if "throughput" not in skip:
                t = time.perf_counter()
                longest = max(lengths)
                print(f"throughput: {longest}-token prompts, {args.throughput_tokens} new "
                      f"tokens, {args.throughput_repeats} repeats", flush=True)
                results["throughput"] = throughput(
                    runner, model, longest, args.throughput_tokens, args.throughput_repeats,
                    args.seed + 11, 0.9)
                results["wall"]["throughput"] = time.perf_counter() - t
                print(report.throughput_table(results), flush=True)
        finally:
            runner.close()
    if args.handoff:
        t = time.perf_counter()
        per_task = (args.handoff_per_task if args.handoff_per_task is not None
                    else max(1, args.per_task // 4))
        results["handoff"] = handoff(model, args, tasks.eval_set(args.seed + 17, per_task,
                                                                 lengths))
        results["wall"]["handoff"] = time.perf_counter() - t
        print(report.handoff_table(results), flush=True)
    results["wall"]["total"] = time.perf_counter() - started
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report.write(results, Path(args.out), Path(args.img))
    print(f"wrote {args.out} and {args.img}/eval_*.png in {results['wall']['total']:.0f} s",
          flush=True)
    if "handoff" in results and not results["handoff"]["identical"]:
        print("handoff: some generations differ from the single-daemon run (the mismatches "
              "column names the samples)", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
