"""The bench's charts: throughput vs load, per-user vs total throughput, latency vs load, the phase breakdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def plot(results: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    targets = sorted({r["target"] for r in results})
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
    for name in targets:
        rows = [r for r in results if r["target"] == name]
        axes.plot([r["value"] for r in rows], [r["output_throughput"] for r in rows], marker="o", label=name)
    axes.set_xlabel("load (concurrency or requests/s)")
    axes.set_ylabel("output tokens/s (Σ output tokens ÷ duration)")
    axes.set_title("Throughput vs load")
    axes.legend()
    axes.grid(alpha=0.3)
    files.append(_save(plt, figure, out / "throughput.png"))

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
    for name in targets:
        rows = [r for r in results if r["target"] == name and r["median_tpot_ms"] > 0]
        axes.plot(
            [r["output_throughput"] for r in rows], [1e3 / r["median_tpot_ms"] for r in rows], marker="o", label=name
        )
        for r in rows:
            axes.annotate(f"{r['value']:g}", (r["output_throughput"], 1e3 / r["median_tpot_ms"]), fontsize=7)
    axes.set_xlabel("total output tokens/s")
    axes.set_ylabel("tokens/s per user (1 ÷ median TPOT)")
    axes.set_title("Per-user vs total throughput (Pareto)")
    axes.legend()
    axes.grid(alpha=0.3)
    files.append(_save(plt, figure, out / "pareto.png"))

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    for name in targets:
        rows = [r for r in results if r["target"] == name]
        for axes, metric in ((left, "ttft"), (right, "tpot")):
            for quantile, style in (("median", "-"), ("p99", "--")):
                axes.plot([r["value"] for r in rows], [r[f"{quantile}_{metric}_ms"] for r in rows], style, marker="o",
                          label=f"{name} {quantile}")  # fmt: skip
    left.set_title("TTFT vs load")
    right.set_title("TPOT vs load")
    for axes in (left, right):
        axes.set_xlabel("load")
        axes.set_ylabel("ms")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    files.append(_save(plt, figure, out / "latency.png"))

    rows = [r for r in results if "server_mean_queue_ms" in r]
    if rows:
        figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
        labels = [f"{r['value']:g}" for r in rows]
        bottom = [0.0] * len(rows)
        for phase in ("frontend", "queue", "prefill", "decode"):
            values = [r.get(f"server_mean_{phase}_ms", 0.0) for r in rows]
            axes.bar(labels, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axes.set_xlabel("load")
        axes.set_ylabel("mean ms per request (server's engine timestamps)")
        axes.set_title("Phase breakdown (phasescope)")
        axes.legend()
        files.append(_save(plt, figure, out / "phases.png"))
    return files
