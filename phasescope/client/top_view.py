"""The frame of `phasescope top`: a `TelemetrySnapshot` in, a rich renderable (or plain text) out.

Pure: it reads no clock (the time shown is the snapshot's), no terminal and
no network. The only state is `TokenRateHistory`, the last minute of each
phase's tokens/s, fed from the snapshots the caller received (the server keeps
no history for a watcher), so a live stream and a replay of its recording draw
the same frames.

rich renders it: a `Group` of lines and `Table`s, which `rich.live.Live` redraws
full-screen and a plain `Console` (no colour system, fixed width) writes as
text for `--once`. rich is already in the serving environment (vLLM depends on
it), has no curses dependency, and measures its own tables, which is what
dropping parts of a frame that does not fit needs. It reads no keys; the
command does that (`phasescope.cli.top`).

A frame that does not fit drops, in order: the sparklines, then the cost
figures, then request rows; what still does not fit is cropped.
"""

from __future__ import annotations

import enum
import io
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from phasescope.telemetry.request.stages import STAGES
from phasescope.v1 import inference_pb2 as pb

SPARKLINE_SPAN_SECONDS = 60.0
SPARKLINE_WIDTH = 20
BAR_WIDTH = 10
_SPARK_LEVELS = "▁▂▃▄▅▆▇█"
_VERDICT_STYLES = {
    "memory": "cyan",
    "compute": "magenta",
    "host": "yellow",
    "queue": "red",
    "idle": "dim",
    "capacity": "bold red",
}


class SortKey(enum.Enum):
    """How the request table is ordered; `s` cycles through them in this order."""

    AGE = "age"
    TOKENS = "tokens"
    TOKENS_PER_SECOND = "tok/s"
    INTERFERENCE = "interference"

    def next(self) -> SortKey:
        members = list(SortKey)
        return members[(members.index(self) + 1) % len(members)]


def sort_requests(
    requests: Iterable[pb.RequestSnapshot], key: SortKey, *, newest_first: bool = False
) -> list[pb.RequestSnapshot]:
    """Oldest first by age (newest first when asked); the other keys put the largest first, ties oldest first."""
    by_age = sorted(requests, key=lambda r: r.age_seconds, reverse=not newest_first)
    if key is SortKey.TOKENS:
        return sorted(by_age, key=lambda r: r.completion_tokens, reverse=True)
    if key is SortKey.TOKENS_PER_SECOND:
        return sorted(by_age, key=lambda r: r.tokens_per_second, reverse=True)
    if key is SortKey.INTERFERENCE:
        return sorted(
            by_age,
            key=lambda r: (r.decode_prefill_interference_seconds, r.decode_stalled_by_prefill_seconds),
            reverse=True,
        )
    return by_age


class TokenRateHistory:
    """Each engine phase's tokens/s over the last `span_seconds` of snapshot time, for the sparklines."""

    def __init__(self, span_seconds: float = SPARKLINE_SPAN_SECONDS) -> None:
        self.span_seconds = span_seconds
        self.latest_unix_seconds: float | None = None
        self._points: dict[tuple[int, str], deque[tuple[float, float]]] = {}

    def add(self, snapshot: pb.TelemetrySnapshot) -> None:
        now = snapshot.time_unix_seconds
        if self.latest_unix_seconds is not None and now < self.latest_unix_seconds:
            # Time went backwards (another server, a restarted replay): the old line no longer applies.
            self._points.clear()
        self.latest_unix_seconds = now
        for engine in snapshot.engines:
            for phase in engine.phases:
                points = self._points.setdefault((engine.engine, phase.phase), deque())
                points.append((now, phase.tokens_per_second))
        for points in self._points.values():
            while points and points[0][0] < now - self.span_seconds:
                points.popleft()

    def points(self, engine: int, phase: str) -> list[tuple[float, float]]:
        return list(self._points.get((engine, phase), ()))

    def sparkline(self, engine: int, phase: str, width: int = SPARKLINE_WIDTH) -> str:
        if self.latest_unix_seconds is None:
            return " " * width
        return sparkline(self.points(engine, phase), self.latest_unix_seconds, self.span_seconds, width)


def sparkline(points: Sequence[tuple[float, float]], now: float, span_seconds: float, width: int) -> str:
    """`width` cells over (now - span, now], each the mean of its points scaled to the largest: blank where none fell.

    The newest point is in the last cell, so a line fills from the right as snapshots arrive.
    """
    cell_seconds = span_seconds / width
    sums = [0.0] * width
    counts = [0] * width
    for at, value in points:
        age = now - at
        if 0 <= age <= span_seconds:
            cell = width - 1 - min(width - 1, int(age / cell_seconds))
            sums[cell] += value
            counts[cell] += 1
    means = [total / count if count else None for total, count in zip(sums, counts, strict=True)]
    top = max((m for m in means if m is not None), default=0.0)
    top_level = len(_SPARK_LEVELS) - 1
    return "".join(" " if m is None else _SPARK_LEVELS[round(m / top * top_level) if top > 0 else 0] for m in means)


@dataclass(frozen=True)
class ViewOptions:
    """What the viewer chose and what the command knows beside the snapshot."""

    sort_key: SortKey = SortKey.AGE
    newest_first: bool = False
    paused: bool = False
    status: str = ""
    """A line under the header: the connection's state, the end of a replay."""
    show_keys: bool = True
    """The key help line (not in --once)."""


@dataclass(frozen=True)
class Detail:
    """How much of the frame to draw; `fit_detail` lowers it until the frame fits."""

    sparklines: bool = True
    cost: bool = True
    request_rows: int | None = None
    """At most this many request rows; None for all listed."""


def si(value: float, unit: str) -> str:
    """13.7 GB/s, 54.6 GFLOP/s: three significant figures with a decimal prefix."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def duration(seconds: float) -> str:
    """A latency: 850 µs, 120 ms, 2.10 s."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.2f} s"


def uptime(seconds: float) -> str:
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def percent(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"


def bar(ratio: float, style: str, width: int = BAR_WIDTH) -> Text:
    """A filled share of `width` cells (clamped to 0..1) and the percentage beside it."""
    filled = round(min(max(ratio, 0.0), 1.0) * width)
    text = Text("█" * filled, style=style)
    text.append("░" * (width - filled), style="dim")
    text.append(f" {percent(ratio):>6}")
    return text


def _table() -> Table:
    # Right padding only: two spaces between columns, so the whole phase table (sparklines, cost) fits 120 columns.
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")


def _header(snapshot: pb.TelemetrySnapshot, options: ViewOptions) -> list[Text]:
    clock = time.strftime("%H:%M:%S", time.localtime(snapshot.time_unix_seconds))
    title = Text.assemble(
        ("phasescope top", "bold"),
        f" · {snapshot.model_name or '?'} on {snapshot.device or '?'}",
        f" · up {uptime(snapshot.uptime_seconds)} · window {snapshot.window_seconds:.1f} s · {clock}",
    )
    peaks = snapshot.peaks
    peaks_line = Text.assemble(
        ("peaks ", "bold"),
        f"{si(peaks.memory_bandwidth_bytes_per_second, 'B/s')} · "
        f"{si(peaks.flops_per_second, 'FLOP/s')} {peaks.dtype or '?'} · "
        f"ridge {peaks.ridge_point_flops_per_byte:.3g} FLOP/byte · "
        f"{peaks.source or '?'} ({peaks.hardware or '?'})",
    )
    admission = snapshot.admission
    rejected_style = "bold red" if admission.rejected_in_interval else ""
    admission_line = Text.assemble(
        ("admission ", "bold"),
        f"in flight {admission.in_flight}/{admission.capacity} · ",
        (f"rejected {admission.rejected_in_interval}", rejected_style),
        " in the last interval",
    )
    lines = [title, peaks_line, admission_line]
    if options.paused:
        lines.append(Text("PAUSED: receiving, not redrawing (p resumes)", style="bold reverse"))
    if options.status:
        lines.append(Text(options.status, style="bold yellow"))
    return lines


def _engine_lines(engine: pb.EngineSnapshot, cost: bool) -> list[Text]:
    headroom_style = "bold red" if engine.headroom < 0.1 else "green"
    summary = Text.assemble(
        (f"engine {engine.engine}", "bold"),
        f"  busy {percent(engine.busy_ratio)} · bandwidth {percent(engine.memory_bandwidth_utilization)}"
        f" · MFU {percent(engine.compute_utilization)} · ",
        (f"headroom {percent(engine.headroom)} ({engine.headroom_limit or '?'})", headroom_style),
    )
    if cost and engine.has_cost:
        summary.append(f" · idle cost ${engine.idle_cost_per_hour:.3g}/h")
    queue = Text(
        f"  queue  running {engine.running} · waiting {engine.waiting} · "
        f"KV cache {percent(engine.kv_cache_usage)} · queue wait {percent(engine.queue_wait_ratio)}"
    )
    lines = [summary, queue]
    if engine.kv_cache_capacity_tokens:
        # The third wall: what the cache holds, who waits for it, and who lost their blocks to it.
        pressed = engine.waiting_for_kv_cache or engine.preemptions_in_window
        fit = f" · fits {engine.kv_cache_sequences_fit:,.0f} seq" if engine.kv_cache_sequences_fit else ""
        lines.append(
            Text.assemble(
                f"  memory KV {engine.kv_cache_tokens:,}/{engine.kv_cache_capacity_tokens:,} tokens{fit} · ",
                (
                    f"waiting for KV {engine.waiting_for_kv_cache}, for a slot {engine.waiting_for_slot} · "
                    f"KV wait {percent(engine.kv_cache_wait_ratio)} · "
                    f"preempted {engine.preemptions_in_window}",
                    "bold red" if pressed else "",
                ),
            )
        )
    if engine.waiting_for_adapters:
        # The adapter-slot wall: requests whose adapter has no slot in the batch (--max-loras).
        lines.append(Text(f"  adapters waiting for an adapter slot {engine.waiting_for_adapters}", style="bold red"))
    if engine.speculative_mean_acceptance_length:
        # Speculative decoding: how much of what the drafter proposes the verify steps keep.
        lines.append(
            Text(
                f"  speculation accepted {percent(engine.speculative_acceptance_rate)} of drafts · "
                f"{engine.speculative_mean_acceptance_length:.2f} tokens per verify step" + _speculation_pays(engine)
            )
        )
    return lines


def _speculation_pays(engine: pb.EngineSnapshot) -> str:
    """ " · pays 2.10×", or why it does not ("verify compute-bound", "acceptance too low")."""
    if not engine.speculative_reading:
        return ""
    gain = f"{engine.speculative_gain:.2f}×"
    if engine.speculative_reading == "paying":
        return f" · pays {gain}"
    why = "verify compute-bound" if engine.speculative_reading == "compute" else "acceptance too low"
    return f" · does not pay ({gain}: {why})"


def _phase_table(engine: pb.EngineSnapshot, history: TokenRateHistory, detail: Detail) -> Table:
    table = _table()
    table.add_column("phase", no_wrap=True)
    table.add_column("bandwidth", no_wrap=True)
    table.add_column("compute", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("tok/s", justify="right", no_wrap=True)
    if detail.sparklines:
        table.add_column("last minute", no_wrap=True)
    table.add_column("host overhead", justify="right", no_wrap=True)
    table.add_column("batch", justify="right", no_wrap=True)
    show_cost = detail.cost and engine.has_cost
    if show_cost:
        table.add_column("$/M tokens", justify="right", no_wrap=True)
    for phase in engine.phases:
        verdict = Text(phase.verdict or "?", style=_VERDICT_STYLES.get(phase.verdict, ""))
        cells: list[RenderableType] = [
            phase.phase,
            bar(phase.memory_bandwidth_utilization, "cyan") if phase.ran else Text("—"),
            bar(phase.compute_utilization, "magenta") if phase.ran else Text("—"),
            verdict,
            f"{phase.tokens_per_second:.1f}",
        ]
        if detail.sparklines:
            cells.append(Text(history.sparkline(engine.engine, phase.phase), style="green"))
        cells += [percent(phase.host_overhead) if phase.ran else "—", f"{phase.batch_size:.1f}" if phase.ran else "—"]
        if show_cost:
            cells.append(f"{phase.cost_per_million_tokens:.3g}" if phase.cost_per_million_tokens else "—")
        table.add_row(*cells)
    return table


def _latency_line(latency: pb.LatencySnapshot) -> Text:
    def quantiles(p50: float, p99: float, samples: int) -> str:
        return f"p50 {duration(p50)} p99 {duration(p99)} ({samples})" if samples else "—"

    ttft = quantiles(
        latency.time_to_first_token_p50_seconds,
        latency.time_to_first_token_p99_seconds,
        latency.time_to_first_token_samples,
    )
    itl = quantiles(latency.inter_token_p50_seconds, latency.inter_token_p99_seconds, latency.inter_token_samples)

    def mean(seconds: float) -> str:
        # 0 when no request ended the phase in the window (a measured duration is never exactly 0).
        return duration(seconds) if seconds else "—"

    # The stages the snapshot carries a window mean for, in the table's order (one inside another, kv_transfer,
    # only when a request in the window had it).
    means = " · ".join(
        f"{stage.name} {mean(getattr(latency, f'{stage.name}_mean_seconds'))}"
        for stage in STAGES
        if f"{stage.name}_mean_seconds" in latency.DESCRIPTOR.fields_by_name
        and (not stage.nested or getattr(latency, f"{stage.name}_mean_seconds"))
    )
    return Text.assemble(("latency ", "bold"), f"TTFT {ttft} · ITL {itl}\n        mean {means}")


def _adapter_section(snapshot: pb.TelemetrySnapshot) -> list[RenderableType]:
    """The requests in flight by LoRA adapter (only when some run with one)."""
    if not snapshot.adapters:
        return []
    table = _table()
    table.add_column("adapter", no_wrap=True, overflow="ellipsis", max_width=36)
    for name in ("in flight", "decoding", "tok/s"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in snapshot.adapters:
        table.add_row(row.adapter, str(row.in_flight), str(row.decoding), f"{row.tokens_per_second:.1f}")
    return [Text("adapters", style="bold"), table, Text()]


def _request_section(snapshot: pb.TelemetrySnapshot, options: ViewOptions, detail: Detail) -> list[RenderableType]:
    ordered = sort_requests(snapshot.requests, options.sort_key, newest_first=options.newest_first)
    shown = ordered if detail.request_rows is None else ordered[: detail.request_rows]
    title = Text.assemble(
        ("requests ", "bold"),
        f"{snapshot.requests_in_flight} in flight, {len(snapshot.requests)} listed",
        f" · sorted by {options.sort_key.value}",
    )
    if not shown:
        return [title, *([Text(f"… {len(ordered)} more", style="dim")] if ordered else [])]
    table = _table()
    table.add_column("id", no_wrap=True, overflow="ellipsis", max_width=36)
    table.add_column("phase", no_wrap=True)
    for name in ("age", "prompt", "tokens", "tok/s", "stalled", "extra"):
        table.add_column(name, justify="right", no_wrap=True)
    for request in shown:
        table.add_row(
            request.request_id,
            request.phase,
            f"{request.age_seconds:.1f} s",
            str(request.prompt_tokens),
            str(request.completion_tokens),
            f"{request.tokens_per_second:.1f}",
            duration(request.decode_stalled_by_prefill_seconds) if request.decode_stalled_by_prefill_seconds else "0",
            duration(request.decode_prefill_interference_seconds)
            if request.decode_prefill_interference_seconds
            else "0",
        )
    section: list[RenderableType] = [title, table]
    if len(shown) < len(ordered):
        section.append(Text(f"… {len(ordered) - len(shown)} more", style="dim"))
    return section


def build_frame(
    snapshot: pb.TelemetrySnapshot, history: TokenRateHistory, options: ViewOptions, detail: Detail = Detail()
) -> Group:
    """The whole frame at one level of detail."""
    parts: list[RenderableType] = [*_header(snapshot, options)]
    for engine in snapshot.engines:
        parts.append(Text())
        parts += _engine_lines(engine, detail.cost)
        parts.append(_phase_table(engine, history, detail))
    parts += [_latency_line(snapshot.latency), Text()]
    parts += _adapter_section(snapshot)
    parts += _request_section(snapshot, options, detail)
    if options.show_keys:
        parts.append(Text(f"p pause · s sort ({options.sort_key.value}) · q quit", style="dim"))
    return Group(*parts)


def _plain_console(width: int, file: io.StringIO | None = None) -> Console:
    # Explicit settings so the environment (FORCE_COLOR, COLUMNS, TERM) cannot add escapes or change the width.
    return Console(
        file=file or io.StringIO(),
        width=width,
        color_system=None,
        force_terminal=False,
        force_interactive=False,
        force_jupyter=False,
        highlight=False,
        emoji=False,
        legacy_windows=False,
    )


def _lines(frame: RenderableType, width: int) -> int:
    console = _plain_console(width)
    return len(console.render_lines(frame, console.options.update(width=width), pad=False))


def _fits_width(frame: Group, width: int) -> bool:
    """Every table at its natural width: rich would otherwise squeeze and wrap columns."""
    console = _plain_console(width)
    # Measured as if the screen were unbounded: Measurement clamps to the options' width.
    unbounded = console.options.update_width(1_000_000)
    return all(
        Measurement.get(console, unbounded, part).maximum <= width
        for part in frame.renderables
        if isinstance(part, Table)
    )


def fit_detail(
    snapshot: pb.TelemetrySnapshot,
    history: TokenRateHistory,
    options: ViewOptions,
    width: int,
    height: int | None = None,
) -> Detail:
    """The most detail that fits `width` x `height`: drop the sparklines, then the cost, then request rows."""

    def fits(detail: Detail) -> bool:
        frame = build_frame(snapshot, history, options, detail)
        return _fits_width(frame, width) and (height is None or _lines(frame, width) <= height)

    for detail in (Detail(), Detail(sparklines=False), Detail(sparklines=False, cost=False)):
        if fits(detail):
            return detail
    smallest = Detail(sparklines=False, cost=False)
    if height is None:
        return smallest
    without_rows = _lines(build_frame(snapshot, history, options, replace(smallest, request_rows=0)), width)
    # Rows need their table's header (two lines: names and rule) and the "… more" line.
    return replace(smallest, request_rows=max(0, height - without_rows - 3))


def render(
    snapshot: pb.TelemetrySnapshot,
    history: TokenRateHistory,
    options: ViewOptions,
    width: int,
    height: int | None = None,
) -> Group:
    """The frame for a `width` x `height` screen (height None: as tall as it needs)."""
    return build_frame(snapshot, history, options, fit_detail(snapshot, history, options, width, height))


def render_text(
    snapshot: pb.TelemetrySnapshot,
    history: TokenRateHistory,
    options: ViewOptions,
    width: int,
    height: int | None = None,
) -> str:
    """The frame as plain text: no colours or escapes, no trailing spaces, lines at most `width` wide."""
    buffer = io.StringIO()
    _plain_console(width, buffer).print(render(snapshot, history, options, width, height))
    return "".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines())


def waiting_frame(message: str) -> Text:
    """What the screen shows before the first snapshot."""
    return Text.assemble(("phasescope top", "bold"), "\n", (message, "bold yellow"))
