"""Engine records a front end waits for (`RecordClaims`): phasescope.v1 beside smg's Rust server reads each of
its requests' engine stamps from the record its engine core published, handed over from the hub's thread."""

from __future__ import annotations

import asyncio
import threading

from phasescope.telemetry.request.engine_side import RecordClaims
from phasescope.telemetry.step.records import EngineRequestRecord


def record(request_id: str) -> EngineRequestRecord:
    return EngineRequestRecord(0, "length", 5, 0, 3, 1.0, 1.1, 1.2, 1.3, request_id=request_id)


async def test_a_claimed_record_reaches_its_claimant_from_the_hubs_thread() -> None:
    claims = RecordClaims()
    mine = claims.claim("req-1")

    def hub() -> None:
        claims.offer(record("other"))
        claims.offer(record("req-1"))

    offered = threading.Thread(target=hub)
    offered.start()
    got = await asyncio.wait_for(mine, 5)
    offered.join()
    assert got.request_id == "req-1"
    assert len(claims) == 0  # handed over, no longer waited for


async def test_a_released_claim_takes_no_record_and_keeps_nothing() -> None:
    claims = RecordClaims()
    mine = claims.claim("req-1")
    claims.release("req-1")
    claims.offer(record("req-1"))
    await asyncio.sleep(0)
    assert not mine.done()
    assert len(claims) == 0
