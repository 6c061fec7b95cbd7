"""The /metrics endpoint: prometheus-client's own formats, with each series' name and labels written once.

prometheus-client writes every sample line from scratch at every scrape: it sorts the labels, checks
and escapes every name and value, then writes the value. Names and labels do not change between
scrapes; values do. A scrape runs in the serving process: writing every line afresh, in text or in
OpenMetrics (the format Prometheus asks for), takes its CPU from the event loop that streams the tokens
(docs/benchmarks.md, "What the telemetry costs").

`CachedExposition` keeps, per encoder, each series' line up to its value, written by that very
encoder (prometheus-client's `generate_latest`, text or OpenMetrics, with the escaping the scrape
asked for) from a copy of the series with the value 0; a scrape then writes the kept part and the
value, formatted by prometheus-client's own `floatToGoString`. A family with anything else on a line
(a timestamp, an exemplar, a native histogram, the text format's OpenMetrics-only series) is
written whole by the encoder, as before. The output is byte for byte the library's
(tests/unit/telemetry/test_endpoint.py compares them on the server's own families).

`start_metrics_server` serves it as `prometheus_client.start_http_server` does: a thread per scrape,
the format from the Accept header, gzip when asked, `name[]` filters (written by the library).
"""

from __future__ import annotations

import copy
import functools
import gzip
import math
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

Encoder = Callable[[Collector], bytes]
_value: Callable[[float], str] = floatToGoString  # how the library writes a value (it leaves it unannotated)

_EOF = "# EOF\n"  # OpenMetrics ends its exposition with it
_ZERO = " " + _value(0.0) + "\n"
# The text format moves these OpenMetrics series to gauges of their own, after the family's lines.
_OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")
# Label sets are bounded (docs/metrics.md); this only keeps a mistake from growing without end.
_MAX_KEPT = 100_000


class _One:
    """A registry of one family, for the encoder."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self._metric]


class _Kept:
    """One encoder's kept text: each family's header lines and each series' line up to its value."""

    def __init__(self, encoder: Encoder, openmetrics: bool) -> None:
        self.encoder = encoder
        self.openmetrics = openmetrics
        self.headers: dict[tuple[str, str, str, str], str] = {}
        self.prefixes: dict[tuple[str, str, tuple[tuple[str, str], ...]], str | None] = {}
        self.values: dict[float, str] = {}

    def write(self, metric: Metric) -> str:
        text = self.encoder(_One(metric)).decode("utf-8")
        return text.removesuffix(_EOF) if self.openmetrics else text

    def header(self, metric: Metric) -> str:
        key = (metric.name, metric.type, metric.documentation, metric.unit)
        header = self.headers.get(key)
        if header is None:
            empty = copy.copy(metric)
            empty.samples = []
            header = self.headers[key] = self.write(empty)
        return header

    def prefix(self, metric: Metric, name: str, labels: dict[str, str]) -> str | None:
        """The sample's line before its value; None where the encoder writes 0 otherwise than expected."""
        key = (metric.name, name, tuple(labels.items()))
        try:
            return self.prefixes[key]
        except KeyError:
            pass
        single = copy.copy(metric)
        single.samples = []
        single.add_sample(name, labels, 0.0)
        line = self.write(single).removeprefix(self.header(metric))
        prefix = line.removesuffix(_ZERO) + " " if line.endswith(_ZERO) and line.count("\n") == 1 else None
        if len(self.prefixes) >= _MAX_KEPT:
            self.prefixes.clear()
        self.prefixes[key] = prefix
        return prefix


class CachedExposition:
    """What a scrape returns, as the encoder prometheus-client chose for it would write it."""

    def __init__(self) -> None:
        self._kept: dict[object, _Kept] = {}

    def _for(self, encoder: Encoder) -> _Kept:
        if isinstance(encoder, functools.partial):
            key: object = (encoder.func, tuple(sorted(encoder.keywords.items())), encoder.args)
            module = encoder.func.__module__
        else:
            key, module = encoder, encoder.__module__
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = _Kept(encoder, module.endswith("openmetrics.exposition"))
        return kept

    def encode(self, registry: Collector, encoder: Encoder) -> bytes:
        kept = self._for(encoder)
        output: list[str] = []
        for metric in registry.collect():
            output.extend(self._family(kept, metric))
        if kept.openmetrics:
            output.append(_EOF)
        return "".join(output).encode("utf-8")

    @staticmethod
    def _family(kept: _Kept, metric: Metric) -> list[str]:
        samples = metric.samples
        moved = () if kept.openmetrics else tuple(metric.name + suffix for suffix in _OPENMETRICS_ONLY)
        if any(
            s.timestamp is not None or s.exemplar is not None or s.native_histogram is not None or s.name in moved
            for s in samples
        ):
            return [kept.write(metric)]
        lines = [kept.header(metric)]
        written = kept.values
        for sample in samples:
            prefix = kept.prefix(metric, sample.name, sample.labels)
            if prefix is None:
                return [kept.write(metric)]
            # Counts repeat from scrape to scrape (a histogram's buckets): each is written once.
            value = sample.value
            keep = _keepable(value)
            text = written.get(value) if keep else None
            if text is None:
                text = _value(value) + "\n"
                if keep:
                    if len(written) >= _MAX_KEPT:
                        written.clear()
                    written[value] = text
            lines.append(prefix + text)
        return lines


def _keepable(value: float) -> bool:
    """A value whose text can be kept under it: not NaN (equal to nothing), not -0.0 (equal to 0.0)."""
    return value == value and (value != 0 or math.copysign(1.0, value) > 0)


def metrics_app(registry: CollectorRegistry) -> Callable[[dict[str, Any], Callable[..., Any]], list[bytes]]:
    """A WSGI app answering as `prometheus_client.make_wsgi_app` does, its formats kept between scrapes."""
    exposition = CachedExposition()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method = environ["REQUEST_METHOD"]
        headers: list[tuple[str, str]]
        if method == "OPTIONS":
            status, headers, output = "200 OK", [("Allow", "OPTIONS,GET")], b""
        elif method != "GET":
            status, headers = "405 Method Not Allowed", [("Allow", "OPTIONS,GET")]
            output = f"# HTTP {status}: {method}; use OPTIONS or GET\n".encode()
        elif environ.get("PATH_INFO") == "/favicon.ico":
            status, headers, output = "200 OK", [], b""
        else:
            encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
            params = parse_qs(environ.get("QUERY_STRING", ""))
            if "name[]" in params:  # a filtered scrape: the library writes it
                # The library leaves out the collectors without names, among them those that hand on held
                # reports first (the step telemetry's, vLLM's): a whole collection runs them (a rare request).
                for _ in registry.collect():
                    pass
                output = encoder(registry.restricted_registry(params["name[]"]))
            else:
                output = exposition.encode(registry, encoder)
            status, headers = "200 OK", [("Content-Type", content_type)]
            if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
                output = gzip.compress(output)
                headers.append(("Content-Encoding", "gzip"))
        start_response(status, headers)
        return [output]

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A scrape is not logged."""


def start_metrics_server(port: int, addr: str, registry: CollectorRegistry) -> tuple[WSGIServer, threading.Thread]:
    """Serves /metrics on a daemon thread, a thread per scrape, as `prometheus_client.start_http_server`."""
    # The address's own family (an IPv6 address does not bind as IPv4), as the library picks it.
    family, _, _, _, address = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(str(address[0]), port, metrics_app(registry), Server, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
