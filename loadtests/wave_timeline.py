"""Where a wave of new requests waits: reads the timeline `front_end_what_if`'s `timeline` writes.

A closed loop of fixed-length requests runs in waves: the streams of one wave end within a few engine steps,
and each sends its next request at once. This prints, from one server's timeline (every request's handler
entry, hand-off to the engine, first chunk written and end, and every hand-on of held telemetry with its
duration):

- each kind of hand-on: how many, how long (median, p90, longest), and how many fell inside a wave's intake
  (from the wave's first handler entry to its last first chunk written), where a stall of the event loop
  delays every first token behind it;
- the waves: how many, how many requests each, how long their intake took;
- one wave from the middle of the run, request by request (every fourth), milliseconds from its first entry.

    PHASESCOPE_TIMELINE_FILE=/tmp/timeline.jsonl .venv/bin/python -m loadtests.serve_ab --tiny-model --b-vllm-grpc \\
        --pin-cpus --a-what-if timeline --concurrency 64 --requests 384 --rounds 2
    .venv/bin/python -m loadtests.wave_timeline /tmp/timeline.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# Requests whose handlers entered within this long of the one before belong to the same wave.
WAVE_GAP_SECONDS = 0.05
# Waves smaller than this (a round's first and last) are left out of the intake figures.
SMALLEST_WAVE = 32


@dataclass
class Request:
    times: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class HandOn:
    at: float
    kind: str
    seconds: float


def read(path: Path) -> tuple[list[Request], list[HandOn]]:
    """The requests that had a first chunk written, in order of entry, and the hand-ons, in order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        events = sorted((json.loads(line) for line in lines), key=lambda event: event[0])
    live: dict[int, Request] = {}
    requests: list[Request] = []
    hand_ons: list[HandOn] = []
    for at, kind, detail in events:
        if kind == "hand_on":
            hand_ons.append(HandOn(at, detail[0], detail[1]))
            continue
        if kind == "entry":  # a lifecycle's id can be reused once it is gone: an entry starts a new request
            live[detail] = Request()
            requests.append(live[detail])
        if detail in live:
            live[detail].times[kind] = at
    answered = [request for request in requests if "first" in request.times]
    return answered, hand_ons


def waves(requests: list[Request]) -> list[list[Request]]:
    grouped: list[list[Request]] = []
    for request in requests:
        if not grouped or request.times["entry"] - grouped[-1][-1].times["entry"] > WAVE_GAP_SECONDS:
            grouped.append([])
        grouped[-1].append(request)
    return grouped


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def report(path: Path) -> None:
    requests, hand_ons = read(path)
    grouped = waves(requests)
    intakes = [
        (min(r.times["entry"] for r in wave), max(r.times["first"] for r in wave))
        for wave in grouped
        if len(wave) >= SMALLEST_WAVE
    ]
    print(f"{len(requests)} requests answered, {len(grouped)} waves ({statistics.median(map(len, grouped)):.0f} each)")
    if intakes:
        spans = [stop - start for start, stop in intakes]
        print(f"a wave's intake (first entry to last first chunk): median {_ms(statistics.median(spans))} ms")
    for kind in sorted({hand_on.kind for hand_on in hand_ons}):
        seconds = sorted(hand_on.seconds for hand_on in hand_ons if hand_on.kind == kind)
        inside = [
            hand_on.seconds
            for hand_on in hand_ons
            if hand_on.kind == kind and any(start <= hand_on.at <= stop for start, stop in intakes)
        ]
        print(
            f"hand-ons of {kind}: {len(seconds)}, median {_ms(statistics.median(seconds))} ms, "
            f"p90 {_ms(seconds[int(0.9 * (len(seconds) - 1))])}, longest {_ms(seconds[-1])}; "
            f"inside {len(intakes)} intakes: {len(inside)}, {_ms(sum(inside))} ms in all"
        )
    entry_to_first = [r.times["first"] - r.times["entry"] for r in requests]
    print(f"handler entry to first chunk written: median {_ms(statistics.median(entry_to_first))} ms")
    middle = grouped[len(grouped) // 2]
    start = middle[0].times["entry"]
    print(f"one wave ({len(middle)} requests), ms from its first entry (every fourth request):")
    for request in middle[::4]:
        moments = [kind for kind in ("entry", "handed", "first", "end") if kind in request.times]
        print("  " + "  ".join(f"{kind} {(request.times[kind] - start) * 1e3:7.1f}" for kind in moments))
    for hand_on in hand_ons:
        if start <= hand_on.at <= max(r.times["first"] for r in middle):
            print(f"  hand-on of {hand_on.kind} at {(hand_on.at - start) * 1e3:.1f}: {_ms(hand_on.seconds)} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path, help="a timeline (JSON lines, or gzipped)")
    report(parser.parse_args().timeline)


if __name__ == "__main__":
    main()
