"""The gateway's shutdown steps are bounded (gateway/core.py): a background task whose cancellation
was lost is cancelled again, and a close that never finishes is given up after CLOSE_TIMEOUT_S,
each logged by name, so SIGTERM always ends the process."""
from __future__ import annotations

import asyncio
import logging
import time

from gateway import core


async def _swallows_one_cancel(stopped: list[str]) -> None:
    """A reader whose first cancellation is taken for its own timeout: it carries on."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass
    try:
        await asyncio.sleep(3600)
    finally:
        stopped.append("second cancel")


def test_a_lost_cancellation_is_repeated():
    stopped: list[str] = []

    async def main() -> float:
        task = asyncio.create_task(_swallows_one_cancel(stopped), name="reader")
        await asyncio.sleep(0)
        t0 = time.monotonic()
        await core._cancel_all([task])
        assert task.done()
        return time.monotonic() - t0

    assert asyncio.run(main()) < 1.0
    assert stopped == ["second cancel"]


def test_a_stuck_close_is_given_up_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(core, "CLOSE_TIMEOUT_S", 0.3)

    async def never_closes() -> None:
        await asyncio.Event().wait()

    async def main() -> float:
        t0 = time.monotonic()
        await core._bounded("the test's close", never_closes())
        return time.monotonic() - t0

    with caplog.at_level(logging.WARNING, logger="kaiten.gateway"):
        elapsed = asyncio.run(main())
    assert 0.3 <= elapsed < 2.0
    assert "the test's close did not finish" in caplog.text


def test_a_task_that_never_stops_is_named_after_the_bound(monkeypatch, caplog):
    monkeypatch.setattr(core, "CLOSE_TIMEOUT_S", 0.5)

    release = asyncio.Event()

    async def immortal() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    async def main() -> None:
        task = asyncio.create_task(immortal(), name="kaiten-immortal")
        await asyncio.sleep(0)
        await core._cancel_all([task])
        assert not task.done()
        release.set()                # the test's own clean-up: let it end
        task.cancel()
        await asyncio.wait([task])

    with caplog.at_level(logging.WARNING, logger="kaiten.gateway"):
        asyncio.run(main())
    assert "kaiten-immortal did not stop within" in caplog.text
