#!/usr/bin/env python3
"""PNG plots of a scaling experiment (matplotlib, pinned in scripts/requirements.txt).

  scripts/plot_scaling.py --validation OUT/validation.csv --report OUT/profile-2x2.json --out DIR

  scaling.png   measured vs predicted generated tokens/s per layout (P stages x E expert-parallel),
                one panel per workload, the prediction's error over each pair of bars
                (validation.csv as scripts/bench_simulate.sh writes it)
  profile.png   per-op time breakdown per rank of a `glm5 batch --profile --report` file: each
                rank's wall time split into its profile phases (summed over layers) and the rest
"""

import argparse
import csv
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_validation(path, out):
    rows = list(csv.DictReader(open(path)))
    if not rows:
        sys.exit(f"plot_scaling: {path} has no rows")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        sel = [r for r in rows if r["workload"] == wl]
        xs = range(len(sel))
        meas = [float(r["measured_tok_s"]) for r in sel]
        pred = [float(r["predicted_tok_s"]) for r in sel]
        ax.bar([x - 0.2 for x in xs], meas, 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], pred, 0.4, label="predicted (glm5 simulate)")
        for x, m, p in zip(xs, meas, pred):
            ax.text(x, max(m, p) * 1.02, f"{100 * (p - m) / m:+.0f}%", ha="center", fontsize=8)
        ax.set_xticks(list(xs), [r["layout"] for r in sel])
        ax.set_xlabel("layout (stages x expert-parallel)")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{wl}: {sel[0]['spec']}")
        ax.set_ylim(0, max(meas + pred) * 1.15)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling.png"), dpi=110)


def plot_profile(path, out):
    report = json.load(open(path))
    ranks = report["ranks"]
    if not any("profile" in r for r in ranks):
        sys.exit(f"plot_scaling: {path} has no profile (run glm5 batch with --profile)")
    per_rank, phases = [], {}
    for r in ranks:
        t = {}
        for p in r.get("profile", []):
            t[p["phase"]] = t.get(p["phase"], 0.0) + p["seconds"]
        t["(rest: scheduling, waits, norms)"] = max(0.0, r["wall_s"] - sum(t.values()))
        per_rank.append(t)
        for k, v in t.items():
            phases[k] = phases.get(k, 0.0) + v
    order = sorted(phases, key=lambda k: -phases[k])
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(ranks)))
    cmap = plt.get_cmap("tab20")
    labels = [f"rank {r['rank']} (stage {r['stage']}, column {r['column']})" for r in ranks]
    left = [0.0] * len(ranks)
    for i, ph in enumerate(order):
        vals = [t.get(ph, 0.0) for t in per_rank]
        ax.barh(labels, vals, left=left, color=cmap(i % 20), label=ph)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds (wall time of the engine run)")
    ax.set_title("per-op time per rank (glm5 batch --profile)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "profile.png"), dpi=110, bbox_inches="tight")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validation", help="validation.csv from scripts/bench_simulate.sh")
    ap.add_argument("--report", help="a glm5 batch --profile --report JSON")
    ap.add_argument("--out", required=True, help="folder for the PNG files")
    a = ap.parse_args()
    if not a.validation and not a.report:
        ap.error("give --validation and/or --report")
    os.makedirs(a.out, exist_ok=True)
    if a.validation:
        plot_validation(a.validation, a.out)
    if a.report:
        plot_profile(a.report, a.out)


if __name__ == "__main__":
    main()
