"""docs/EVALUATION.md: the page kvcache-eval writes. Fixed prose, the run's numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from . import report, tasks


def _wall(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def render(results: Dict[str, Any], images: List[str], img: Path) -> str:
    meta = results.get("train_meta", {})
    cfg = results["model"]
    wall = results["wall"]
    parts: List[str] = []
    add = parts.append
    add("<!-- Written by clients/eval/kvcache-eval; edit clients/eval/kvcache_eval/page.py, "
        "not this file. -->")
    add("# Evaluation: the paper's claims on a decoder trained here, through kvcached\n")
    add("The InertiaKV paper (../shared/reference/inertiakv-paper.md) makes claims about what "
        "eviction does to a model. This page measures them end to end: a small Llama-style "
        "decoder trained in this repository on synthetic long-context tasks in RULER's "
        "shapes is driven by a real `kvcached`, which decides every eviction; the decoder's "
        "K/V live in the daemon's host shared-memory KV pool, and its scores are folded and "
        "written into a shared-memory score region (docs/PYTHON.md, `kvcache_client.torch`). "
        "Every number below was printed by the command that wrote this page.\n")
    add("```sh\n" + results["command"] + "\n```\n")
    add(f"Wall time: {_wall(wall['total'])} in all ("
        + ", ".join(f"{k} {_wall(v)}" for k, v in wall.items() if k != "total")
        + f") on {results['machine']}.\n")
    add(_verdicts(results))
    add(_setup(results, meta, cfg))
    if "main" in results:
        add("## Accuracy and cost, every preset\n")
        add(f"Exact match (every answer token right), {results['per_task']} samples per task, "
            f"contexts {', '.join(map(str, results['lengths']))} tokens. *Retained*: tokens "
            "cached after the last step (the budget `B = floor((1 - ρ) L0)`, mean over "
            "samples; the full cache keeps all). *tokens/s*: decode steps per second of "
            "the whole loop, model included, over these short answers. *capture*: share of "
            "decode time inside score capture; *round trip*: share spent sending the step "
            "and waiting for the daemon's decision (paid on every step, scored or not).\n")
        if "eval_accuracy.png" in images:
            add(f"![accuracy vs compression]({img / 'eval_accuracy.png'})\n")
        add(report.accuracy_grid(results) + "\n")
        add("Per task:\n")
        add(report.main_tables(results) + "\n")
        add(MAIN_NOTES)
    if "ablations" in results:
        r = results["ablations"]["ratio"]
        add(f"## Ablations at ρ = {r}\n")
        add("### Scorers: VNorm and entropy against plain attention\n")
        add("The same task set with the scorer changed, under EMA (inertia) and under "
            "single-step scoring (tova); *Jaccard* is the overlap of the cached position "
            "sets after every decode step, averaged over steps and samples (1 = identical "
            "evictions).\n")
        add(report.ablation_tables(results) + "\n")
        if "eval_ablations.png" in images:
            add(f"![ablations]({img / 'eval_ablations.png'})\n")
        add(ABLATION_NOTES)
    if "shift" in results:
        s = results["shift"]
        add("## Relevance shift: the question changes mid-generation\n")
        add(f"A multi-key prompt asks about one key; after the model's answer, {s['gap']} "
            "filler tokens and a question about another key are fed as decode steps (each one "
            "a step the daemon decides on), and the model answers again. The paper names "
            "this as Score-Free's failure: its ranking is frozen at step 1, when only the "
            f"first question mattered. {len(tasks.TASKS) and results['per_task'] * 2} samples.\n")
        add(report.shift_table(results) + "\n")
        add(SHIFT_NOTES)
    if "throughput" in results:
        t = results["throughput"]
        add("## Throughput: full refresh, Lazy4, Score-Free\n")
        add(f"{t['repeats']} prompts of {t['length']} tokens (the longest context here), "
            f"{t['new_tokens']} decode steps each, ρ = {t['ratio']}, end to end: the model's "
            "decode step, score capture, the daemon round trip (gRPC stream, scores through "
            "the score region), and applying the decision to the pooled cache. The "
            "configurations run interleaved on the same prompts. Milliseconds per decoded "
            "token:\n")
        add(report.throughput_table(results) + "\n")
        if "eval_throughput.png" in images:
            add(f"![where decode time goes]({img / 'eval_throughput.png'})\n")
        add(_throughput_notes(results))
    add(REPRODUCE)
    return "\n".join(parts).rstrip() + "\n"


def _verdicts(results: Dict[str, Any]) -> str:
    lines = ["## The paper's claims, as measured here\n"]
    lines += [f"- {v}" for v in report.verdicts(results)]
    return "\n".join(lines) + "\n"


def _setup(results: Dict[str, Any], meta: Dict[str, Any], cfg: Dict[str, Any]) -> str:
    held = meta.get("held_out_exact_match", {})
    return (
        "## Set-up\n\n"
        f"- **Model** (`clients/eval/kvcache_eval/model.py`): a Llama-style decoder, "
        f"{cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} query heads and "
        f"{cfg['kv_heads']} KV heads of {cfg['head_dim']} (GQA), RoPE, RMSNorm, SwiGLU "
        f"({cfg['ffn']}), tied embeddings, vocabulary {cfg['vocab']}; "
        f"{results['parameters']:,} parameters.\n"
        f"- **Weights**: `{results['weights']}`, made by `{meta.get('command', '?')}` in "
        f"{_wall(meta.get('wall_seconds', 0))} ({meta.get('steps', '?')} steps, "
        f"{meta.get('threads', '?')} threads); held-out exact match at the end: "
        + ", ".join(f"{report.TASK_NAMES.get(k, k)} {v:.2f}" for k, v in held.items())
        + ".\n"
        "- **Tasks** (`clients/eval/kvcache_eval/tasks.py`), RULER's shapes over digits, "
        "letters, 20 filler words and a few marks: *single* (one needle `# k = 3 9 1 4 .`, "
        "`? k :`), *multikey* (four needles, distinct keys, one asked), *multivalue* (two "
        "needles with the same key, both values asked, `v1 , v2 .`), *multiquery* (four "
        "needles, two keys asked at once), *vt* (variable tracking: `# a = 3 9 1 4 .`, "
        "`# b = a .`, `# c = b .` and a decoy chain; `? 3 9 1 4 :` asks for `a b c .`). "
        "Needles at uniform depths; answers of 4 to 10 tokens; seeded.\n"
        "- **Decoding**: greedy. The first answer token comes from the prefill; decode step "
        "t feeds the token at position L0 + t - 1 (its true RoPE position), attends over the "
        "cache plus itself, and the daemon then evicts. So the first two answer tokens are "
        "predicted before any eviction, and the rest after it: eviction can only hurt from "
        "the third answer token on.\n"
        "- **Worker** (`clients/eval/kvcache_eval/runner.py`, `kvcache_client.torch`): "
        "prefill K/V written into the daemon's pool at the slots it leased; per step the "
        "capture recomputes each layer's attention row from the query and the keys (what a "
        "worker with a fused attention kernel must do), folds the 4 rows with the "
        "daemon's fold weights, writes the row into the score region; the decision's "
        "evictions, compaction moves and new-token slot are applied to the pooled cache.\n")


MAIN_NOTES = ""
ABLATION_NOTES = ""
SHIFT_NOTES = ""


def _throughput_notes(results: Dict[str, Any]) -> str:
    return ""


REPRODUCE = (
    "## Reproducing\n\n"
    "From a fresh clone, after the README's set-up (`scripts/install-deps.sh`, which "
    "installs `python3-torch`, `libopenblas0-pthread` and `python3-matplotlib`, and the "
    "build):\n\n"
    "```sh\n"
    "clients/eval/kvcache-eval                 # this page and docs/img/eval_*.png\n"
    "PYTHONPATH=clients/eval python3 -m kvcache_eval.train --out clients/eval/weights/decoder.pt"
    "   # the weights (optional)\n"
    "ctest --test-dir build -L python          # includes tests/python/test_eval.py\n"
    "```\n\n"
    "`kvcache-eval --help` lists the knobs (`--per_task`, `--lengths`, `--skip`, "
    "`--json`). Accuracies are deterministic for a given seed and weights; the timings "
    "vary with the machine and its load.\n")
