"""The PNG: serve throughput, epoch throughput (headline and growth), and targets met."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on CI or over ssh
import matplotlib.pyplot as plt


def _median(case: dict[str, Any], figure: str) -> float:
    return case["figures"][figure]["median"]


def _serve(ax, cases: list[dict[str, Any]]) -> None:
    serve = [c for c in cases if c["case"] == "serve"]
    for rows, nodes in sorted({(c["rows"], c["nodes"]) for c in serve}):
        points = sorted((c["clients"], c) for c in serve if (c["rows"], c["nodes"]) == (rows, nodes))
        xs = [p[0] for p in points]
        line = ax.plot(
            xs, [_median(c, "gb_per_s") for _, c in points], marker="o", label=f"{rows:,} rows, {nodes} node(s)"
        )
        ax.plot(xs, [_median(c, "loopback_gb_per_s") for _, c in points], ls=":", color=line[0].get_color())
    ax.set(title="Serve: DoGet GB/s (dotted: loopback TCP)", xlabel="clients", ylabel="GB/s (all clients)")
    ax.set_xticks(sorted({c["clients"] for c in serve}))
    ax.legend(fontsize=7)


def _epoch_headline(ax, cases: list[dict[str, Any]], rows: int) -> None:
    epoch = [c for c in cases if c["case"] == "epoch" and c["rows"] == rows]
    methods = list(dict.fromkeys(c["variant"] for c in epoch))
    width = 0.38
    for k, shuffled in enumerate((False, True)):
        vals = [
            next((_median(c, "rows_per_s") for c in epoch if c["variant"] == m and c["shuffled"] == shuffled), 0)
            for m in methods
        ]
        ax.bar(
            [i + (k - 0.5) * width for i in range(len(methods))],
            vals,
            width,
            label="shuffled" if shuffled else "in order",
        )
    ax.set_xticks(range(len(methods)), methods, fontsize=8)
    ax.set(title=f"Epoch into tensors, {rows:,} rows", ylabel="rows/s")
    ax.legend(fontsize=7)


def _epoch_growth(ax, cases: list[dict[str, Any]]) -> None:
    epoch = [c for c in cases if c["case"] == "epoch"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, method in enumerate(dict.fromkeys(c["variant"] for c in epoch)):
        for shuffled in (False, True):
            pts = sorted(
                (c["rows"], _median(c, "rows_per_s"))
                for c in epoch
                if c["variant"] == method and c["shuffled"] == shuffled
            )
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    marker="o",
                    color=colors[k % len(colors)],
                    ls="--" if shuffled else "-",
                    label=f"{method}{' shuffled' if shuffled else ''}",
                )
    ax.set(
        title="Epoch rows/s by table size (dashed: shuffled)",
        xlabel="rows",
        ylabel="rows/s",
        xscale="log",
        yscale="log",
    )
    ax.legend(fontsize=6)


def _targets(ax, heads: list[dict[str, Any]]) -> None:
    """Each target as measured/target (>= targets) or target/measured (<= targets): >= 1 meets it."""
    names, scores, colors = [], [], []
    for h in heads:
        if h["measured"] is None or h["met"] is None:  # none measured, or broken (report.verdict)
            continue
        target = float(h["target"].split()[1].rstrip("x%")) / (100 if h["unit"] == "pct" else 1)
        ge = h["target"].startswith(">=")
        scores.append(h["measured"] / target if ge else target / h["measured"])
        names.append(h["figure"])
        colors.append("tab:green" if h["met"] else "tab:red")
    ax.barh(range(len(names)), scores, color=colors)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set(title="Targets: score >= 1 meets the target", xlabel="measured vs target (log)")


def plot(result: dict[str, Any], path: Path, heads: list[dict[str, Any]]) -> None:
    cases = result["cases"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    _serve(axes[0][0], cases)
    _epoch_headline(axes[0][1], cases, result["config"]["headline_rows"])
    _epoch_growth(axes[1][0], cases)
    _targets(axes[1][1], heads)
    fig.suptitle(f"data cache benchmark ({result['config']['name']}, {result['created']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
