"""Admission: how many requests the server holds at once, and how many one caller may.

A request holds a permit from before it is tokenised until it ends, whichever protocol
it came in by: `async with admission.permit(caller):`. A refused request holds nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from phasescope.errors import ClientLimitError, OverloadedError


class Admission:
    """Counts requests in flight and refuses those beyond running + queued capacity, and
    (with a per-client limit) those beyond what one caller may have in flight."""

    def __init__(self, max_running: int, max_queued: int, per_client: int = 0) -> None:
        self.capacity = max_running + max_queued
        self.max_running = max_running
        self.max_queued = max_queued
        self.per_client = per_client
        self.in_flight = 0
        # Only callers with requests in flight have an entry: it is removed at zero.
        self._by_client: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @asynccontextmanager
    async def permit(self, caller: str) -> AsyncIterator[None]:
        """What a request holds while it is in flight, given back on exit whatever happened; entering it raises
        when the server or the caller is at its limit. `caller` only matters with a per-client limit."""
        caller = caller if self.per_client else ""
        self._acquire(caller)
        try:
            yield
        finally:
            self._release(caller)

    def _acquire(self, caller: str) -> None:
        if self.in_flight >= self.capacity:
            raise OverloadedError(
                f"server at capacity: {self.in_flight} requests in flight "
                f"(--max-concurrent-requests {self.max_running} running + "
                f"--max-queued-requests {self.max_queued} waiting); retry later"
            )
        held = self._by_client.get(caller, 0)
        if self.per_client and held >= self.per_client:
            raise ClientLimitError(
                f"this client is at its limit of {self.per_client} requests in flight "
                "(--max-requests-per-client); wait for one to finish"
            )
        self._by_client[caller] = held + 1
        self.in_flight += 1
        self._idle.clear()

    def _release(self, caller: str) -> None:
        held = self._by_client.pop(caller) - 1
        if held:
            self._by_client[caller] = held
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()
