"""What a /metrics scrape costs the server that answers it: its CPU (user + system) per scrape, by format.

    .venv/bin/python loadtests/scrape_cost.py --pid PID --url http://127.0.0.1:9400/metrics --scrapes 100

Run it on a server that has served some load (its histograms filled) and is idle now: the figure is
the server's CPU over the scrapes ÷ their count, in the text format and in OpenMetrics (the format
Prometheus asks for), each `--rounds` times.
"""

from __future__ import annotations

import argparse
import urllib.request

import psutil

FORMATS = {"text": "text/plain;version=0.0.4", "openmetrics": "application/openmetrics-text;version=1.0.0"}


def scrape(url: str, accept: str) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as response:
        body: bytes = response.read()
        return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pid", type=int, required=True, help="the serving process")
    parser.add_argument("--url", required=True)
    parser.add_argument("--scrapes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    server = psutil.Process(args.pid)
    for round_ in range(1, args.rounds + 1):
        for name, accept in FORMATS.items():
            lines = scrape(args.url, accept).count(b"\n")
            before = server.cpu_times()
            for _ in range(args.scrapes):
                scrape(args.url, accept)
            after = server.cpu_times()
            seconds = (after.user - before.user) + (after.system - before.system)
            print(f"round {round_} {name:>11}: {seconds / args.scrapes * 1e3:5.1f} ms per scrape ({lines} lines)")


if __name__ == "__main__":
    main()
