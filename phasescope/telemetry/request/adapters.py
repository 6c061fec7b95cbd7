"""The `adapter` label of the request series, kept bounded.

Requests on the base model are `base`. Each LoRA adapter a request runs with is its own label, by its name, for
the first `limit` distinct adapters seen; every later one, and a name the worker does not serve (a refused
request's: client input, not a served adapter), is `other`. A name keeps its label while the server runs, loaded
again or not, so a series never changes meaning; an adapter past the limit is seen only in `other` (its requests,
tokens and latency still count there, and GetModelInfo lists it by name).
"""

from __future__ import annotations

import threading

BASE_ADAPTER = "base"
OTHER_ADAPTERS = "other"
DEFAULT_ADAPTER_LABELS = 32


class AdapterLabels:
    """Each adapter's label (`label`); one per server, shared by the request series (the event loop) and the
    adapter step series (where steps are aggregated)."""

    def __init__(self, limit: int = DEFAULT_ADAPTER_LABELS) -> None:
        self._limit = limit
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def label(self, adapter: str, served: bool = True) -> str:
        """The label of a request for `adapter` ("": the base model); `served`: the worker serves it."""
        if not adapter:
            return BASE_ADAPTER
        if adapter in self._named:
            return adapter
        with self._lock:
            if served and (adapter in self._named or len(self._named) < self._limit):
                self._named.add(adapter)
                return adapter
        return OTHER_ADAPTERS
