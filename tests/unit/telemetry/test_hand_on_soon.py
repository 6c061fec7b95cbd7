"""A held batch of telemetry is handed on after what is ready, and not while a request waits for its first token."""

import asyncio

from phasescope.telemetry.held import FirstTokenWaits, HandOnSoon


def test_a_batch_waits_while_a_request_waits_for_its_first_token_and_goes_once_none_does() -> None:
    waits = FirstTokenWaits()
    waiting = [True]
    waits.watch(lambda: waiting[0])
    handed: list[float] = []

    async def serve() -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        soon = HandOnSoon(lambda: handed.append(loop.time()), waits)
        soon()
        soon()  # asked again before it ran: one hand-on
        await asyncio.sleep(0.02)
        while_waiting = len(handed)
        waiting[0] = False
        await asyncio.sleep(0.02)
        once_none_waits = len(handed)
        await asyncio.sleep(0.02)
        return while_waiting, once_none_waits, len(handed)

    assert asyncio.run(serve()) == (0, 1, 1)


def test_a_batch_never_waits_longer_than_its_bound() -> None:
    waits = FirstTokenWaits()
    waits.watch(lambda: True)  # a load under which some request always waits
    handed: list[str] = []

    async def serve() -> tuple[int, int]:
        soon = HandOnSoon(lambda: handed.append("batch"), waits)
        soon.longest_wait = 0.05
        soon()
        await asyncio.sleep(0.02)
        early = len(handed)
        await asyncio.sleep(0.1)
        return early, len(handed)

    assert asyncio.run(serve()) == (0, 1)


def test_with_no_request_waiting_a_batch_goes_after_what_is_ready_and_off_a_loop_at_once() -> None:
    order: list[str] = []

    async def serve() -> None:
        soon = HandOnSoon(lambda: order.append("batch"), FirstTokenWaits())
        asyncio.get_running_loop().call_soon(lambda: order.append("a chunk's write"))
        soon()
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(serve())
    assert order == ["a chunk's write", "batch"]
    HandOnSoon(lambda: order.append("off the loop"))()
    assert order[-1] == "off the loop"
