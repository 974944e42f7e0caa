#!/usr/bin/python3
"""The capacity plots of docs/BENCHMARKS.md ("Capacity") from `kvcache-loadgen --serve --json`.

    /usr/bin/python3 scripts/plot_capacity.py build/capacity.json --out=docs/img

Writes capacity_rho.png (decoding sequences at once and decode tokens/s against rho per
policy, the full cache as a baseline line, the hand-off as its own point) and
capacity_occupancy.png (the decode node's pool occupancy over each run).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def load(path):
    with open(path) as f:
        data = json.load(f)
    configs = data.get("configs")
    if not configs:
        sys.exit(f"plot_capacity: {path} holds no configurations")
    return configs


def plot_rho(configs, out):
    fig, (conc, tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = sorted({c["preset"] for c in configs if not c["full"] and not c["handoff"]})
    for policy in policies:
        rows = sorted((c for c in configs if c["preset"] == policy and not c["full"]
                       and not c["handoff"]), key=lambda c: c["rho"])
        rho = [c["rho"] for c in rows]
        conc.plot(rho, [c["decoding_mean"] for c in rows], marker="o", label=policy)
        tput.plot(rho, [c["tokens_per_second"] for c in rows], marker="o", label=policy)
    for c in configs:
        if c["full"]:
            for ax, key in ((conc, "decoding_mean"), (tput, "tokens_per_second")):
                ax.axhline(c[key], color="grey", linestyle="--", label="full cache")
        if c["handoff"]:
            for ax, key in ((conc, "decoding_mean"), (tput, "tokens_per_second")):
                ax.plot([c["rho"]], [c[key]], marker="*", markersize=14, linestyle="none",
                        color="black", label=f"hand-off ({c['preset']})")
    conc.set_ylabel("decoding sequences at once (mean)")
    tput.set_ylabel("decode tokens / s")
    for ax in (conc, tput):
        ax.set_xlabel("compression ratio rho")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    conc.legend(fontsize=8)
    fig.suptitle("Requests served at once on one KV pool")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_occupancy(configs, out):
    """One panel per configuration: the pool's used blocks and the admission ledger."""
    shown = [c for c in configs if c["occupancy"]]
    cols = 4
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(13, 2.4 * rows), sharex=True, sharey=True,
                             squeeze=False)
    for ax, c in zip(axes.flat, shown):
        cap = c["capacity_blocks"]
        t = [s[0] for s in c["occupancy"]]
        ax.plot(t, [100.0 * s[1] / cap for s in c["occupancy"]], linewidth=0.7,
                label="used (DescribeKvPools)")
        ax.plot(t, [100.0 * s[2] / cap for s in c["occupancy"]], linewidth=0.7,
                linestyle="--", label="admission ledger")
        ax.set_title(f"{c['config']}: {c['decoding_mean']:.0f} decoding", fontsize=9)
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("pool blocks (%)")
    for ax in axes[-1, :]:
        ax.set_xlabel("seconds")
    axes.flat[0].legend(fontsize=7, loc="lower center")
    fig.suptitle("Decode node's KV pool over each run (sampled every iteration)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="kvcache-loadgen --serve --json output")
    parser.add_argument("--out", default="docs/img", help="folder for the two PNGs")
    args = parser.parse_args()
    configs = load(args.json)
    os.makedirs(args.out, exist_ok=True)
    plot_rho(configs, os.path.join(args.out, "capacity_rho.png"))
    plot_occupancy(configs, os.path.join(args.out, "capacity_occupancy.png"))
    print(f"plot_capacity: wrote capacity_rho.png and capacity_occupancy.png to {args.out}")


if __name__ == "__main__":
    main()
