"""The tables, plots and the page (docs/EVALUATION.md) of kvcache-eval's results.

Every number on the page comes from the results dict of one run; the prose around the
tables is fixed text here (what was measured, and why the model differs from the paper's
LLMs); the verdicts on the paper's claims are computed from the numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from kvcache_client.policy import PRESETS  # the one list: cache_manager/policy/presets.txt

from . import diagnostics, tasks

TASK_NAMES = {"niah_single": "single", "niah_multikey": "multikey",
              "niah_multivalue": "multivalue", "niah_multiquery": "multiquery", "vt": "vt"}
RATIOS = (0.5, 0.8, 0.9)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# -- sections ------------------------------------------------------------------------------

def main_tables(results: Dict[str, Any]) -> str:
    main = results["main"]
    task_cols = [t for t in tasks.TASKS]
    header = ["configuration", *[TASK_NAMES[t] for t in task_cols], "overall",
              "evidence kept", "right if kept", "retained", "tokens/s", "capture",
              "round trip"]
    rows = []
    for name, s in main.items():
        rows.append([name, *[s["by_task"].get(t, float("nan")) for t in task_cols],
                     s["accuracy"], pct(s.get("evidence_kept", 1.0)),
                     f"{s.get('correct_if_kept', float('nan')):.2f} ({s.get('kept_samples', 0)})",
                     f"{s['retained']:.0f}",
                     f"{s['tokens_per_s']:.0f}",
                     pct(s["capture_share"]), pct(s["step_share"])])
    return table(header, rows)


def accuracy_grid(results: Dict[str, Any]) -> str:
    main = results["main"]
    full = main["full"]["accuracy"]
    rows = []
    for preset in PRESETS:
        rows.append([preset, *[main.get(f"{preset}@{r}", {}).get("accuracy", float("nan"))
                               for r in RATIOS]])
    return table(["preset", *[f"ρ = {r}" for r in RATIOS]], rows) + \
        f"\n\nFull cache: {full:.2f}."


def ablation_tables(results: Dict[str, Any]) -> str:
    a = results["ablations"]
    r = a["ratio"]
    runs, jac = a["runs"], a["jaccard"]
    out = []
    rows = []
    for kind, label in (("ema", "EMA α 0.8 (inertia)"), ("single", "single step (tova)")):
        base = runs[f"{kind}-attention@{r}"]["accuracy"]
        rows.append([label, base, runs[f"{kind}-vnorm@{r}"]["accuracy"],
                     runs[f"{kind}-entropy@{r}"]["accuracy"],
                     jac[f"{kind}-vnorm"], jac[f"{kind}-entropy"]])
    out.append(table(["aggregation", "attention", "VNorm", "entropy",
                      "Jaccard attention/VNorm", "Jaccard attention/entropy"], rows))
    out.append("")
    out.append(f"Jaccard of single-step (tova) against EMA (inertia) cached sets: "
               f"{jac['single-vs-ema']:.2f}.")
    out.append("")
    rows = [[f"α = {alpha}", *[runs[f"alpha{alpha}@{r}"]["by_task"].get(t, float("nan"))
                              for t in tasks.TASKS], runs[f"alpha{alpha}@{r}"]["accuracy"]]
            for alpha in (0.0, 0.5, 0.8, 0.9, 0.95)]
    out.append(table(["EMA", *[TASK_NAMES[t] for t in tasks.TASKS], "overall"], rows))
    out.append("")
    rows = []
    for name in ("lazy1", "lazy2", "lazy4", "lazy8", "score_free"):
        s = runs[f"{name}@{r}"]
        label = {"lazy1": "every step (r = 1)", "score_free": "Score-Free"}.get(
            name, f"Lazy r = {name[4:]}")
        rows.append([label, *[s["by_task"].get(t, float("nan")) for t in tasks.TASKS],
                     s["accuracy"], pct(s["scoring_share"]), f"{s['tokens_per_s']:.0f}",
                     pct(s["capture_share"])])
    out.append(table(["refresh", *[TASK_NAMES[t] for t in tasks.TASKS], "overall",
                      "scoring steps", "tokens/s", "capture"], rows))
    return "\n".join(out)


def shift_table(results: Dict[str, Any]) -> str:
    s = results["shift"]
    rows = []
    names = [n for n in s["runs"] if "+" not in n]  # the composed ones: their own table
    for name in names:
        v = s["runs"][name]
        rows.append([name, v["first"], v["second"], v["both"]])
    return table(["configuration", "first question", "second question", "both"], rows)


def ci(interval: Dict[str, float], digits: int = 2, scale: float = 1.0) -> str:
    """``+0.16 [+0.09, +0.23]`` of a bootstrap.Interval's fields (``scale`` 100: points)."""
    f = f"{{:+.{digits}f}}"
    return (f"{f.format(scale * interval['estimate'])} [{f.format(scale * interval['low'])}, "
            f"{f.format(scale * interval['high'])}]")


VARIANT_LABEL = {"plain": "plain", "window": "+ window", "span": "+ span pooling",
                 "both": "+ window + span pooling"}


def _name(preset: str, variant: str, ratio: float) -> str:
    suffix = {"plain": "", "window": "+window", "span": "+span", "both": "+window+span"}
    return f"{preset}{suffix[variant]}@{ratio}"


def sweep_table(results: Dict[str, Any]) -> str:
    sw = results["composed"]["sweep"]
    header = ["window w", *[f"k = {k}" if k > 1 else "no span pooling" for k in sw["spans"]]]
    rows = []
    for w in sw["windows"]:
        cells = []
        for k in sw["spans"]:
            g = sw["grid"][f"{w},{k}"]
            cells.append(f"{pct(g['evidence_kept'])} / {g['accuracy']:.2f}")
        rows.append([str(w) if w else "0 (off)", *cells])
    return table(header, rows)


def composed_evidence_table(results: Dict[str, Any]) -> str:
    c = results["composed"]
    runs, against = c["runs"], c["comparisons"]["against_plain"]
    rows = []
    for variant in c["variants"]:
        cells = []
        for r in c["ratios"]:
            name = _name("inertia", variant, r)
            cell = pct(runs[name]["evidence_kept"])
            if variant != "plain":
                cell += f" ({ci(against[name]['evidence_kept'], 1, 100)} pts)"
            cells.append(cell)
        kept = runs[_name("inertia", variant, max(c["ratios"]))]["first_token_kept"]
        rows.append([VARIANT_LABEL[variant], *cells, pct(kept)])
    return table(["step 1", *[f"ρ = {r}" for r in c["ratios"]],
                  f"new token kept at {max(c['ratios'])}"], rows)


def composed_accuracy_table(results: Dict[str, Any]) -> str:
    c = results["composed"]
    runs, against = c["runs"], c["comparisons"]["against_plain"]
    rows = [["full cache", *[f"{runs['full']['accuracy']:.2f}"] * len(c["ratios"])]]
    for preset in c["presets"]:
        for variant in c["variants"]:
            cells = []
            for r in c["ratios"]:
                name = _name(preset, variant, r)
                cell = f"{runs[name]['accuracy']:.2f}"
                if variant != "plain":
                    cell += f" ({ci(against[name]['accuracy'])})"
                cells.append(cell)
            rows.append([f"{preset} {VARIANT_LABEL[variant]}", *cells])
    return table(["configuration", *[f"ρ = {r}" for r in c["ratios"]]], rows)


def composed_shift_table(results: Dict[str, Any]) -> str:
    s = results["shift"]
    runs, comp = s["runs"], s["composed"]
    rows = []
    for ratio in s["ratios"]:
        for preset in ("inertia", "inertia_lazy4", "score_free"):
            plain = runs[f"{preset}@{ratio}"]
            rows.append([f"{preset}@{ratio}", plain["first"], plain["second"], plain["both"],
                         "", ""])
            name = _name(preset, s["composed_variant"], ratio)
            v = runs[name]
            rows.append([name, v["first"], v["second"], v["both"], ci(comp[name]["second"]),
                         ci(comp[name]["both"])])
    return table(["configuration", "first question", "second question", "both",
                  "Δ second", "Δ both"], rows)


def composed_tables(results: Dict[str, Any]) -> str:
    parts = []
    if results["composed"].get("sweep"):
        parts.append(sweep_table(results))
    parts += [composed_evidence_table(results), composed_accuracy_table(results)]
    return "\n\n".join(parts)


def diagnostics_table(results: Dict[str, Any]) -> str:
    d = results["diagnostics"]
    rows = []
    for policy in d["live"]:
        live, offline = d["live"][policy], d["offline"][policy]
        for source, figures in (("live", live), ("offline", offline)):
            rows.append([f"{policy} ({source})", f"{figures.get('steps', 0):.0f}",
                         *[f"{v:.3f}" for v in diagnostics.means(
                             figures or diagnostics.empty()).values()]])
    return table(["policy (source)", "measured steps", *diagnostics.READINGS], rows)


def throughput_table(results: Dict[str, Any]) -> str:
    t = results["throughput"]
    rows = []
    for name, r in t["rows"].items():
        rows.append([name, f"{r['tokens_per_s']:.0f}", f"{r['model_ms_per_token']:.3f}",
                     f"{r['capture_ms_per_token']:.3f}", f"{r['step_ms_per_token']:.3f}",
                     f"{r['apply_ms_per_token']:.3f}",
                     f"{1000 / r['tokens_per_s']:.3f}"])
    return table(["configuration", "tokens/s", "model ms", "capture ms", "round trip ms",
                  "apply ms", "total ms/token"], rows)


def handoff_table(results: Dict[str, Any]) -> str:
    h = results["handoff"]
    rows = []
    for name, r in h["runs"].items():
        kib = r["kv_bytes_mean"] / 1024
        full = r["prefill_kv_bytes_mean"] / 1024
        rows.append([name, f"{r['identical']}/{r['samples']}", r["transport"] or "-",
                     f"{kib:.1f}", f"{full:.1f}",
                     f"{r['kv_bytes_mean'] / r['prefill_kv_bytes_mean']:.3f}"
                     if r["prefill_kv_bytes_mean"] else "-",
                     f"{r['record_bytes_mean']:.0f}", f"{1000 * r['seconds_mean']:.2f}",
                     ",".join(map(str, r["mismatches"][:8])) or "-"])
    return table(["configuration", "identical", "transport", "K/V moved KiB",
                  "whole prefill KiB", "moved / whole", "state bytes", "import ms",
                  "mismatches"], rows)


# -- verdicts ------------------------------------------------------------------------------

def verdicts(results: Dict[str, Any]) -> List[str]:
    """The paper's claims, each with what this run measured and whether it holds here."""
    out = []
    main = results.get("main")
    if main:
        full = main["full"]["accuracy"]
        get = lambda p, r: main[f"{p}@{r}"]["accuracy"]  # noqa: E731
        inertia9 = get("inertia", 0.9)
        others = {p: get(p, 0.9) for p in ("tova", "h2o", "streaming_llm", "random")}
        best_other = max(others, key=others.get)
        holds = all(inertia9 > v for v in others.values())
        out.append(
            f"**InertiaKV keeps quality at 90% compression where single-step scoring and "
            f"unscored eviction do not.** Inertia {inertia9:.2f} against tova "
            f"{others['tova']:.2f}, h2o {others['h2o']:.2f}, streaming_llm "
            f"{others['streaming_llm']:.2f}, random {others['random']:.2f} (full cache "
            f"{full:.2f}): " + ("holds: inertia is above every baseline."
                                if holds else f"does not hold: {best_other} "
                                f"({others[best_other]:.2f}) is not below inertia."))
        lazy9 = get("inertia_lazy4", 0.9)
        out.append(f"**Lazy4 costs almost nothing in quality.** Lazy4 {lazy9:.2f} against "
                   f"full refresh {inertia9:.2f} at 0.9 (Δ {lazy9 - inertia9:+.2f}): "
                   + ("holds." if abs(lazy9 - inertia9) <= 0.05 else
                      "does not hold (more than 0.05 apart)."))
        deltas = [get("score_free", r) - get("inertia", r) for r in RATIOS]
        mean_delta = sum(deltas) / len(deltas)
        out.append(f"**Score-Free changes quality by +0.03 on average.** Score-Free minus "
                   f"full refresh at 0.5/0.8/0.9: "
                   + ", ".join(f"{d:+.2f}" for d in deltas) + f" (mean {mean_delta:+.2f}): "
                   + ("holds (within 0.05 of zero on average)." if abs(mean_delta) <= 0.05
                      else "does not hold."))
    ab = results.get("ablations")
    if ab:
        jac = ab["jaccard"]
        ema = min(jac["ema-vnorm"], jac["ema-entropy"])
        single = min(jac["single-vnorm"], jac["single-entropy"])
        out.append(f"**EMA makes order-preserving scorer changes invisible (Jaccard 0.97).** "
                   f"Jaccard of the cached sets, attention against VNorm/entropy: EMA "
                   f"{jac['ema-vnorm']:.2f}/{jac['ema-entropy']:.2f}, single step "
                   f"{jac['single-vnorm']:.2f}/{jac['single-entropy']:.2f}: "
                   + ("holds (≥ 0.9 under EMA)." if ema >= 0.9 else "does not hold (< 0.9).")
                   + (" EMA is the more stable of the two." if ema > single else
                      " EMA is not more stable than single-step scoring here."))
        runs, r = ab["runs"], ab["ratio"]
        alpha = {a: runs[f"alpha{a}@{r}"]["accuracy"] for a in (0.0, 0.5, 0.8, 0.9, 0.95)}
        best = max(alpha, key=alpha.get)
        out.append(f"**Retrieval prefers strong smoothing (α 0.9-0.95), α = 0 is worst.** "
                   + ", ".join(f"α {a}: {v:.2f}" for a, v in alpha.items()) + ": "
                   + ("holds." if best >= 0.8 and alpha[0.0] <= min(alpha.values()) + 1e-9
                      else f"partly or not: the best α here is {best}."))
    shift = results.get("shift")
    if shift:
        ratio = max(shift["ratios"])
        sf = shift["runs"][f"score_free@{ratio}"]["second"]
        inertia = shift["runs"][f"inertia@{ratio}"]["second"]
        out.append(f"**Score-Free fails when relevance shifts later in generation.** Second "
                   f"question at {ratio}: Score-Free {sf:.2f}, inertia {inertia:.2f}: "
                   + ("holds (Score-Free is lower)." if sf < inertia - 0.05 else
                      "does not appear here."))
    tp = results.get("throughput")
    if tp:
        rows = tp["rows"]
        full = rows["inertia (full refresh)"]["tokens_per_s"]
        lazy = rows["inertia_lazy4"]["tokens_per_s"]
        sf = rows["score_free"]["tokens_per_s"]
        out.append(f"**Lazy4 gives 1.34-1.46x decode throughput over full refresh.** Here "
                   f"{lazy / full:.2f}x (Score-Free {sf / full:.2f}x) at "
                   f"{tp['length']} tokens: "
                   + ("holds." if lazy / full >= 1.34 else "does not hold: see below why."))
    return out


# -- plots ---------------------------------------------------------------------------------

def plots(results: Dict[str, Any], img: Path) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    written = []
    main = results.get("main")
    if main:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        full = main["full"]["accuracy"]
        for preset in PRESETS:
            ys = [full] + [main[f"{preset}@{r}"]["accuracy"] for r in RATIOS]
            ax.plot([0.0, *RATIOS], ys, marker="o", label=preset)
        ax.set_xlabel("compression ratio ρ (0 = full cache)")
        ax.set_ylabel("exact-match accuracy (all tasks)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks([0.0, *RATIOS])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
        ax.set_title("Accuracy vs compression, decoder trained here, through kvcached")
        fig.tight_layout()
        fig.savefig(img / "eval_accuracy.png")
        plt.close(fig)
        written.append("eval_accuracy.png")
    ab = results.get("ablations")
    if ab:
        runs, r = ab["runs"], ab["ratio"]
        fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.6), dpi=110)
        alphas = (0.0, 0.5, 0.8, 0.9, 0.95)
        axes[0].bar([str(a) for a in alphas],
                    [runs[f"alpha{a}@{r}"]["accuracy"] for a in alphas], color="#2b5c8a")
        axes[0].set_xlabel("EMA α")
        axes[0].set_ylabel(f"accuracy at ρ = {r}")
        axes[0].set_ylim(0, 1)
        names = ("lazy1", "lazy2", "lazy4", "lazy8", "score_free")
        labels = ("r=1", "r=2", "r=4", "r=8", "Score-\nFree")
        axes[1].bar(labels, [runs[f"{n}@{r}"]["accuracy"] for n in names], color="#8a5c2b")
        axes[1].set_xlabel("refresh")
        axes[1].set_ylim(0, 1)
        fig.suptitle(f"Ablations at ρ = {r}")
        fig.tight_layout()
        fig.savefig(img / "eval_ablations.png")
        plt.close(fig)
        written.append("eval_ablations.png")
    if results.get("composed"):
        written.append(_composed_plot(results["composed"], img, plt))
    tp = results.get("throughput")
    if tp:
        rows = tp["rows"]
        names = list(rows)
        parts = (("model_ms_per_token", "model"), ("capture_ms_per_token", "capture"),
                 ("step_ms_per_token", "daemon round trip"), ("apply_ms_per_token", "apply"))
        fig, ax = plt.subplots(figsize=(8.0, 4.2), dpi=110)
        left = [0.0] * len(names)
        for key, label in parts:
            widths = [rows[n][key] for n in names]
            ax.barh(names, widths, left=left, label=label)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel("ms per decoded token")
        ax.legend(fontsize=8)
        ax.set_title(f"Where decode time goes, {tp['length']}-token prompt, ρ = {tp['ratio']}")
        fig.tight_layout()
        fig.savefig(img / "eval_throughput.png")
        plt.close(fig)
        written.append("eval_throughput.png")
    return written


def _composed_plot(c: Dict[str, Any], img: Path, plt: Any) -> str:
    """Evidence kept after step 1 and accuracy against ρ, inertia in every variant."""
    runs, ratios = c["runs"], c["ratios"]
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.8), dpi=110)
    for variant in c["variants"]:
        names = [_name("inertia", variant, r) for r in ratios]
        axes[0].plot(ratios, [runs[n]["evidence_kept"] for n in names], marker="o",
                     label=VARIANT_LABEL[variant])
        axes[1].plot(ratios, [runs[n]["accuracy"] for n in names], marker="o",
                     label=VARIANT_LABEL[variant])
    axes[1].axhline(runs["full"]["accuracy"], color="grey", linestyle="--", label="full cache")
    axes[0].set_ylabel("evidence kept after step 1")
    axes[1].set_ylabel("exact-match accuracy")
    for ax in axes:
        ax.set_xlabel("compression ratio ρ")
        ax.set_xticks(list(ratios))
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Inertia, step 1 composed with prefill-time selection (w = {c['window']}, "
                 f"k = {c['span_pool']})")
    fig.tight_layout()
    fig.savefig(img / "eval_composed.png")
    plt.close(fig)
    return "eval_composed.png"


# -- the page ------------------------------------------------------------------------------

def write(results: Dict[str, Any], out: Path, img: Path) -> None:
    from . import page
    written = plots(results, img)
    rel = Path("img")
    out.write_text(page.render(results, written, rel))
