"""The run's report: report.md beside bench.json.gz and the PNG plots, and the tables printed at the end.

Markdown with linked PNG files rather than one HTML page with embedded images: the
folder can be committed as it is (docs/data/) and reads on GitHub and in any editor, the
tables diff line by line between runs, and the images stay files a reader can open alone;
a self-contained HTML page would be one opaque, base64-swollen blob in review.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phasescope.bench.rounds import ROUND_FIGURES


def _number(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}"


def figure(point: dict[str, Any], name: str, digits: int = 1, percent: bool = False) -> str:
    """`median` or, with repeats that differ, `median [min–max]`; — when the point lacks it."""
    if name not in point:
        return "—"
    scale, suffix = (100.0, " %") if percent else (1.0, "")
    text = _number(point[name] * scale, digits)
    spread = point.get("spread", {}).get(name)
    if spread and spread["min"] != spread["max"]:
        text += f" [{_number(spread['min'] * scale, digits)}–{_number(spread['max'] * scale, digits)}]"
    return text + suffix


def acceptance(point: dict[str, Any]) -> str:
    """Speculative decoding's acceptance at a point, `62.5 % · 2.9 tok/step` (the share of drafted tokens accepted,
    the tokens a sequence emits per verify step), each with its [min–max] over repeats that differ; — without."""
    if "speculative_acceptance_rate" not in point:
        return "—"
    rate = figure(point, "speculative_acceptance_rate", 1, percent=True)
    return f"{rate} · {figure(point, 'speculative_mean_acceptance_length', 1)} tok/step"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def plan_lines(results: dict[str, Any]) -> list[str]:
    """One sentence per target: the search's answer with its bracket and spread, or where a sweep stopped."""
    lines = []
    unit = {"rate": "requests/s", "concurrency": "concurrent requests", "burst": "requests per burst"}
    for plan in results.get("plans", []):
        target = plan["target"]
        if plan.get("mode") == "search":
            load, target_ratio = plan["load"], plan["goodput_target"]
            low, high = plan["bracket"]
            objectives = ", ".join(f"{name} ≤ {value:g}" for name, value in results["slo"].items())
            head = f"**{target}**: highest {load} with goodput ratio ≥ {target_ratio:g} ({objectives})"
            if plan["status"] == "never_passed":
                lines.append(f"{head}: none — even {high:.3g} {unit[load]} failed (the limit is below it).")
                continue
            ratio = plan.get("goodput_ratio_at_answer", {})
            at = (f"goodput ratio there {ratio['median']:.3f} (min–max {ratio['min']:.3f}–{ratio['max']:.3f} "
                  f"over {results['parameters']['repeats']} repeats)") if ratio else ""  # fmt: skip
            if plan["status"] == "never_failed":
                lines.append(f"{head}: ≥ **{low:.3g}** {unit[load]} — every point passed, the answer is a lower "
                             f"bound ({plan['points_run']} points); {at}.")  # fmt: skip
            else:
                note = "" if plan["converged"] else " (point budget spent before the bracket narrowed)"
                above = plan.get("goodput_ratio_at_first_failing")
                beyond = (f"; at {high:.3g}: {above['median']:.3f} ({above['min']:.3f}–{above['max']:.3f})"
                          if above else "")  # fmt: skip
                lines.append(f"{head}: **{low:.3g}** {unit[load]}, bracket [{low:.3g}, {high:.3g}]{note}; {at}"
                             f"{beyond}; {plan['points_run']} points.")  # fmt: skip
            if plan.get("answer_over_saturated"):
                lines.append(f"  (at {low:.3g} the run was flagged over-saturated: a longer run may not hold it.)")
        elif plan.get("saturation_stop"):
            stop = plan["saturation_stop"]
            skipped = ", ".join(f"{v:g}" for v in stop["skipped"]) or "none"
            lines.append(f"**{target}**: rate sweep stopped at {stop['value']:g} requests/s, over-saturated — "
                         f"{'; '.join(stop['reasons'])}; rates not run: {skipped}.")  # fmt: skip
    return lines


LATENCY_HEADER = ["target", "load", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                  "E2E p50 ms", "errors"]  # fmt: skip
HARDWARE_HEADER = ["target", "load", "MBU device", "MBU decode", "MFU device", "compute idle", "prefill verdict",
                   "decode verdict", "decode host overhead", "KV cache mean / max", "queue wait",
                   "headroom (limit)"]  # fmt: skip


def _load(point: dict[str, Any]) -> str:
    return f"{point['load']} {point['value']:.3g}"


def latency_rows(points: list[dict[str, Any]], slo: dict[str, float]) -> tuple[list[str], list[list[str]]]:
    header = list(LATENCY_HEADER)
    if slo:
        header[3:3] = ["goodput ratio", "goodput req/s", "goodput tok/s"]
    cpu = any("frontend_cpu_seconds_per_1k_tokens" in p for p in points)
    if cpu:
        header.append("front-end CPU s/1k tok")
    speculative = any("speculative_acceptance_rate" in p for p in points)
    if speculative:
        header.append("accepted")
    header.append("over-saturated")
    rows = []
    for p in points:
        row = [p["target"], _load(p), figure(p, "request_throughput", 2), figure(p, "output_throughput"),
               figure(p, "median_ttft_ms"), figure(p, "p99_ttft_ms"), figure(p, "median_tpot_ms"),
               figure(p, "median_e2el_ms", 0), figure(p, "errors", 0)]  # fmt: skip
        if slo:
            row[3:3] = [figure(p, "goodput_ratio", 1, percent=True), figure(p, "request_goodput", 2),
                        figure(p, "output_goodput")]  # fmt: skip
        if cpu:
            row.append(figure(p, "frontend_cpu_seconds_per_1k_tokens", 3))
        if speculative:
            row.append(acceptance(p))
        saturation = p.get("saturation", {})
        row.append(f"yes ({saturation['runs_flagged']}/{p['repeats']})" if saturation.get("over_saturated") else "no")
        rows.append(row)
    return header, rows


def hardware_rows(points: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for p in points:
        if "server_device_bandwidth_saturation" not in p:
            continue
        kv_mean, kv_max = (figure(p, f"server_{k}kv_cache_usage_ratio", 1, percent=True) for k in ("", "max_"))
        headroom = f"{figure(p, 'server_headroom_ratio', 2)} ({p.get('server_headroom_limit', '—')})"
        rows.append([p["target"], _load(p), figure(p, "server_device_bandwidth_saturation", 1, True),
                     figure(p, "server_decode_bandwidth_saturation", 1, True),
                     figure(p, "server_device_compute_utilization", 2, True),
                     figure(p, "server_device_compute_idleness", 1, True), p.get("server_prefill_verdict", "—"),
                     p.get("server_decode_verdict", "—"), figure(p, "server_decode_host_overhead_ratio", 2),
                     f"{kv_mean} / {kv_max}", figure(p, "server_queue_wait_ratio", 1, True), headroom])  # fmt: skip
    return rows


ROUND_HEADER = ["target", "load", "rounds", "output tok/s", "TTFT p50", "TPOT p50", "front-end CPU / 1k tok"]


def _ratio(row: dict[str, Any], name: str) -> str:
    """`median [low–high] (higher in k)`: the median of the rounds' ratios, its 95 % interval, and in how many
    rounds the target's figure was the higher; — when no round has both figures."""
    figure = row["figures"].get(name)
    if figure is None:
        return "—"
    return f"{figure['median']:.3f} [{figure['low']:.3f}–{figure['high']:.3f}] ({figure['higher']})"


def round_rows(round_ratios: list[dict[str, Any]]) -> list[list[str]]:
    return [[row["target"], _load(row), str(row["rounds"]), *(_ratio(row, name) for name in ROUND_FIGURES)]
            for row in round_ratios]  # fmt: skip


def round_lines(round_ratios: list[dict[str, Any]]) -> list[str]:
    """The table of each target ÷ the baseline, round by round, with what its cells mean."""
    if not round_ratios:
        return []
    baseline = round_ratios[0]["baseline"]
    return [f"Each target ÷ {baseline}, round by round: the median of the rounds' ratios [its 95 % bootstrap "
            "interval] (in how many rounds the target's figure was the higher).", "",
            *_table(ROUND_HEADER, round_rows(round_ratios))]  # fmt: skip


def print_round_ratios(round_ratios: list[dict[str, Any]]) -> None:
    lines = round_lines(round_ratios)
    if lines:
        print("\n" + "\n".join(lines))


def _by_target_and_load(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target's points together (in the order the targets ran), by load: a search runs them out of order."""
    order = list(dict.fromkeys(p["target"] for p in points))
    return sorted(points, key=lambda p: (order.index(p["target"]), p["load"], p["value"]))


def write_report(results: dict[str, Any], plots: list[Path], out: Path) -> Path:
    parameters, slo = results["parameters"], results["slo"]
    points = _by_target_and_load(results["points"])
    lines = [f"# phasescope bench — {results['started']}", "", "```sh", results["command"], "```", ""]
    plans = plan_lines(results)
    if plans:
        lines += ["## Result", "", *plans, ""]
    repeats = parameters["repeats"]
    lines += ["## Points", "",
              f"Each figure is the median over {repeats} repeat(s)" + (", with [min–max]" if repeats > 1 else "")
              + f"; {parameters['requests']} measured requests per run.", ""]  # fmt: skip
    header, rows = latency_rows(points, slo)
    lines += [*_table(header, rows), ""]
    rounds = round_lines(results.get("round_ratios", []))
    if rounds:
        lines += ["## Each target beside the baseline, round by round", "", *rounds, ""]
    hardware = hardware_rows(points)
    if hardware:
        lines += ["## The hardware at each point (the server's /metrics over the point)", "",
                  *_table(HARDWARE_HEADER, hardware), ""]  # fmt: skip
    lines += ["## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots), ""]
    lines += ["## Definitions", "", *(f"- `{name}`: {text}" for name, text in results["formulas"].items()), ""]
    lines += ["## Parameters", "", *_table(["parameter", "value"], [[k, f"`{v}`"] for k, v in parameters.items()])]
    if results.get("settings"):
        lines += ["", "Engine settings: " + ", ".join(f"{k} `{v}`" for k, v in results["settings"].items()) + "."]
    machine = results.get("machine", {})
    lines += ["", "Machine: " + ", ".join(f"{k} `{v}`" for k, v in machine.items()) + ".",
              "", "Raw results, every run and request (gzipped JSON): [bench.json.gz](bench.json.gz).", ""]  # fmt: skip
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def print_tables(results: dict[str, Any]) -> None:
    print("\n" + "\n".join(f"  {value}" for value in results["formulas"].values()))
    points = _by_target_and_load(results["points"])
    header, rows = latency_rows(points, results["slo"])
    print("\n".join(_table(header, rows)))
    hardware = hardware_rows(points)
    if hardware:
        print("\n".join(_table(HARDWARE_HEADER, hardware)))
    for row in results["ratios"]:
        print("ratios " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    print_round_ratios(results.get("round_ratios", []))
    for line in plan_lines(results):
        print(line)
