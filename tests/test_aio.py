"""Cancellation-safe waiting (shared/aio.py): a loop stopped by cancel() always stops."""

from __future__ import annotations

import asyncio
import sys

import pytest

from shared.aio import cancel_and_wait, wait_event


async def _loop(wait) -> None:
    event = _loop.event
    while True:
        await wait(event)
        event.clear()


async def _stops_when_cancelled_as_the_event_fires(wait) -> bool:
    """The race that 3.11's wait_for loses: the event is set and the task cancelled in the
    same tick, before the task runs again."""
    _loop.event = asyncio.Event()
    task = asyncio.create_task(_loop(wait))
    await asyncio.sleep(0.01)           # the task is waiting on the event
    _loop.event.set()
    task.cancel()
    await asyncio.wait({task}, timeout=0.5)
    stopped = task.done()
    if not stopped:
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    return stopped


async def test_wait_event_reports_set_and_timeout():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5) is True
    assert await wait_event(event, 0) is True   # already set


async def test_a_loop_waiting_with_wait_event_never_loses_its_cancellation():
    assert await _stops_when_cancelled_as_the_event_fires(lambda ev: wait_event(ev, 1.0))


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps cancellations from 3.12 on")
async def test_wait_for_loses_it_on_this_python_which_is_why_wait_event_exists():
    assert not await _stops_when_cancelled_as_the_event_fires(lambda ev: asyncio.wait_for(ev.wait(), 1.0))


async def test_cancel_and_wait_ends_a_task_that_swallows_one_cancellation():
    swallowed = []

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)     # the first one is lost, as in the wait_for race

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0.01)
    await asyncio.wait_for(cancel_and_wait(task, retry_s=0.05), 5)
    assert task.cancelled() and swallowed == [1]
    await cancel_and_wait(None)
