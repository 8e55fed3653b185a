"""Cancellation-safe waiting, for the loops that gateways and workers stop by cancelling.

Python 3.11's `asyncio.wait_for` loses a cancellation that arrives while the awaited thing has
just completed: it returns the result instead of raising (gh-86296, fixed in 3.12). A loop that
waits on an event with `wait_for` every few milliseconds is then sometimes not stopped by
`task.cancel()`, and whoever awaits the task after cancelling it waits forever (seen as a
worker that did not exit after SIGTERM and a gateway whose shutdown hung). `asyncio.timeout`
counts cancellations and never loses one; `cancel_and_wait` also copes with code that swallows
one anyway.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """True if `event` is set within `timeout` seconds, False on timeout; a cancellation of the
    caller always propagates."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
        return True
    except TimeoutError:
        return False


async def cancel_and_wait(task: asyncio.Task | None, *, retry_s: float = 0.5) -> None:
    """Cancel `task` and wait until it has ended, cancelling again every `retry_s` while it runs
    on (a cancellation swallowed by code it awaits). Its result or exception is discarded."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning
