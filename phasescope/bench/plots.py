"""The bench's charts, PNG files beside bench.json.gz; medians with min–max bars when a point has repeats.

throughput.png (output tokens/s vs load), latency.png (TTFT and TPOT vs load, with the
objectives), pareto.png (tokens/s per user vs tokens/s in total, coloured by bandwidth
saturation), goodput.png (goodput ratio and goodput vs load, the search's bracket),
hardware.png (MBU, MFU, KV-cache use and queue wait vs load) and phases.png (the server's
phase breakdown).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phasescope.telemetry.request.stages import ANSWERED

Series = dict[tuple[str, str], list[dict[str, Any]]]


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _series(points: list[dict[str, Any]], having: str = "") -> Series:
    """Points by (target, load), in order of load."""
    series: Series = {}
    for point in sorted(points, key=lambda p: p["value"]):
        if not having or having in point:
            series.setdefault((point["target"], point["load"]), []).append(point)
    return series


def _bars(rows: list[dict[str, Any]], name: str) -> list[list[float]] | None:
    """Min–max around the median, as matplotlib's asymmetric error bars (None without repeats)."""
    spreads = [row.get("spread", {}).get(name) for row in rows]
    if any(s is None for s in spreads) or all(s["min"] == s["max"] for s in spreads if s):
        return None
    return [[row[name] - s["min"] for row, s in zip(rows, spreads, strict=True) if s],
            [s["max"] - row[name] for row, s in zip(rows, spreads, strict=True) if s]]  # fmt: skip


def _line(axes: Any, rows: list[dict[str, Any]], name: str, label: str, style: str = "-") -> None:
    axes.errorbar([r["value"] for r in rows], [r[name] for r in rows], yerr=_bars(rows, name), fmt=style,
                  marker="o", capsize=3, label=label)  # fmt: skip


def _load_label(loads: set[str]) -> str:
    return {"concurrency": "concurrency", "rate": "Poisson rate (requests/s)", "burst": "requests per burst"}.get(
        next(iter(loads)) if len(loads) == 1 else "", "load (concurrency, requests/s or burst size)"
    )


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: list[dict[str, Any]] = results["points"]
    slo: dict[str, float] = results.get("slo") or {}
    series = _series(points)
    xlabel = _load_label({p["load"] for p in points})
    files = []

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
    for (target, load), rows in series.items():
        _line(axes, rows, "output_throughput", f"{target} ({load})")
    axes.set(xlabel=xlabel, ylabel="output tokens/s (Σ output tokens ÷ duration)", title="Throughput vs load")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    files.append(_save(plt, figure, out / "throughput.png"))

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    for (target, load), rows in series.items():
        for axes, metric in ((left, "ttft"), (right, "tpot")):
            _line(axes, rows, f"median_{metric}_ms", f"{target} ({load}) median")
            _line(axes, rows, f"p99_{metric}_ms", f"{target} ({load}) p99", "--")
    for axes, metric, title in ((left, "ttft_ms", "TTFT vs load"), (right, "tpot_ms", "TPOT vs load")):
        if metric in slo:
            axes.axhline(slo[metric], color="red", linestyle=":", label=f"objective {slo[metric]:g} ms")
        axes.set(xlabel=xlabel, ylabel="ms", title=title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    files.append(_save(plt, figure, out / "latency.png"))

    figure, axes = plt.subplots(figsize=(7.5, 5), dpi=100)
    coloured = [p for p in points if "server_device_bandwidth_saturation" in p and p["tokens_per_second_per_user"]]
    scale = max([p["server_device_bandwidth_saturation"] for p in coloured], default=1.0) or 1.0
    for (target, load), rows in series.items():
        rows = [r for r in rows if r["tokens_per_second_per_user"]]
        xs, ys = [r["output_throughput"] for r in rows], [r["tokens_per_second_per_user"] for r in rows]
        axes.plot(xs, ys, color="grey", linewidth=0.8, zorder=1)
        with_mbu = [r for r in rows if "server_device_bandwidth_saturation" in r]
        if with_mbu:
            dots = axes.scatter([r["output_throughput"] for r in with_mbu],
                                [r["tokens_per_second_per_user"] for r in with_mbu],
                                c=[r["server_device_bandwidth_saturation"] for r in with_mbu], cmap="viridis",
                                vmin=0.0, vmax=scale, s=60, zorder=2, label=f"{target} ({load})")  # fmt: skip
        else:
            axes.scatter(xs, ys, facecolors="none", edgecolors="black", s=50, zorder=2,
                         label=f"{target} ({load}, no server metrics)")  # fmt: skip
        for r in rows:
            axes.annotate(f"{r['value']:.3g}", (r["output_throughput"], r["tokens_per_second_per_user"]), fontsize=7,
                          xytext=(4, 4), textcoords="offset points")  # fmt: skip
    if coloured:
        figure.colorbar(dots, ax=axes, label="bandwidth saturation (MBU, device, over the point)")
    axes.set(xlabel="tokens/s in total (output)", ylabel="tokens/s per user (1000 ÷ median TPOT ms)",
             title="Per-user vs total throughput (Pareto); labels: load")  # fmt: skip
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    files.append(_save(plt, figure, out / "pareto.png"))

    if slo:
        figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
        for (target, load), rows in series.items():
            _line(left, rows, "goodput_ratio", f"{target} ({load})")
            _line(right, rows, "request_throughput", f"{target} ({load}) requests/s")
            _line(right, rows, "request_goodput", f"{target} ({load}) goodput requests/s", "--")
        for plan in results.get("plans", []):
            if plan.get("mode") == "search":
                left.axhline(plan["goodput_target"], color="red", linestyle=":", label="goodput target")
                low, high = plan["bracket"]
                if low is not None and high is not None:
                    left.axvspan(low, high, alpha=0.15, label=f"{plan['target']} bracket [{low:.3g}, {high:.3g}]")
        objectives = ", ".join(f"{name} ≤ {value:g}" for name, value in slo.items())
        left.set(xlabel=xlabel, ylabel="share of requests meeting every objective", ylim=(-0.02, 1.05),
                 title=f"Goodput ratio ({objectives})")  # fmt: skip
        right.set(xlabel=xlabel, ylabel="requests/s", title="Throughput and goodput")
        for axes in (left, right):
            axes.grid(alpha=0.3)
            axes.legend(fontsize=7)
        files.append(_save(plt, figure, out / "goodput.png"))

    served = _series(points, having="server_device_bandwidth_saturation")
    if served:
        figure, grid = plt.subplots(2, 2, figsize=(11, 8), dpi=100)
        panels = (
            (grid[0][0], (("server_device_bandwidth_saturation", "device"), ("server_decode_bandwidth_saturation",
             "decode")), "bandwidth saturation (MBU)"),
            (grid[0][1], (("server_device_compute_utilization", "device"), ("server_prefill_compute_utilization",
             "prefill")), "compute utilisation (MFU)"),
            (grid[1][0], (("server_kv_cache_usage_ratio", "mean"), ("server_max_kv_cache_usage_ratio", "max")),
             "KV-cache usage"),
            (grid[1][1], (("server_queue_wait_ratio", "mean"), ("server_headroom_ratio", "headroom")),
             "queue-wait share and headroom"),
        )  # fmt: skip
        for axes, figures, title in panels:
            for (target, load), rows in served.items():
                for name, what in figures:
                    if all(name in r for r in rows):
                        _line(axes, rows, name, f"{target} ({load}) {what}")
            axes.set(xlabel=xlabel, ylabel="ratio", title=title)
            axes.grid(alpha=0.3)
            axes.legend(fontsize=7)
        files.append(_save(plt, figure, out / "hardware.png"))

    rows = [p for p in points if "server_mean_queue_ms" in p]
    if rows:
        figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
        labels = [f"{r['load'][0]}={r['value']:.3g}" for r in rows]
        bottom = [0.0] * len(rows)
        for stage in ANSWERED:
            values = [r.get(f"server_mean_{stage.name}_ms", 0.0) for r in rows]
            axes.bar(labels, values, bottom=bottom, label=stage.name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axes.set(xlabel="load (c = concurrency, r = requests/s)", ylabel="mean ms per request (server's timestamps)",
                 title="Phase breakdown (phasescope)")  # fmt: skip
        axes.tick_params(axis="x", labelrotation=45, labelsize=7)
        axes.legend()
        files.append(_save(plt, figure, out / "phases.png"))
    return files
