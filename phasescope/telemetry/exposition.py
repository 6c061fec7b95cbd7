"""Reading a /metrics exposition back: for the roofline calculator's live points, the benchmarks and the tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# (sample name, its labels) -> value
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_samples(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def fetch_samples(url: str, timeout: float = 10.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_samples(response.read().decode())


def sum_samples(samples: Samples, name: str, **labels: str) -> float:
    """Sum of a series over every label set that includes `labels`."""
    wanted = set(labels.items())
    return sum(
        value for (sample, sample_labels), value in samples.items() if sample == name and wanted <= sample_labels
    )
