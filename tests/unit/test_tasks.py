"""Backoff and TaskSupervisor: the agent's retry delays and its long-lived tasks."""

from __future__ import annotations

import asyncio
import random

import pytest

from daemon.tasks import Backoff, TaskSupervisor

pytestmark = pytest.mark.unit


def test_backoff_grows_by_the_factor_and_caps_without_jitter() -> None:
    b = Backoff(initial=0.1, maximum=1.0, factor=2.0, jitter=0.0, rng=random.Random(0))
    assert [b.next() for _ in range(7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])


def test_backoff_jitter_stays_within_bounds_and_varies() -> None:
    b = Backoff(initial=1.0, maximum=8.0, factor=2.0, jitter=0.25, rng=random.Random(42))
    bases = [1.0, 2.0, 4.0, 8.0] + [8.0] * 200
    delays = [b.next() for _ in bases]
    for base, delay in zip(bases, delays, strict=True):
        assert base * 0.75 <= delay <= base * 1.25
    capped = delays[4:]
    assert max(capped) - min(capped) > 2.0  # actually jittered, across most of the band
    assert any(d < 8.0 for d in capped) and any(d > 8.0 for d in capped)


def test_backoff_is_reproducible_with_a_seeded_rng() -> None:
    def delays(seed: int) -> list[float]:
        b = Backoff(rng=random.Random(seed))
        return [b.next() for _ in range(10)]

    assert delays(7) == delays(7)
    assert delays(7) != delays(8)


def test_backoff_reset_starts_again_from_initial() -> None:
    b = Backoff(initial=0.5, maximum=10.0, jitter=0.0, rng=random.Random(0))
    for _ in range(5):
        b.next()
    assert b.next() == pytest.approx(10.0)
    b.reset()
    assert b.next() == pytest.approx(0.5)
    assert b.next() == pytest.approx(1.0)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_long_lived_task_that_raises_fails_the_supervisor() -> None:
    async def boom() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("etcd went away")

    async def main() -> str:
        sup = TaskSupervisor()
        sup.spawn(boom(), "watch-nodes")
        await asyncio.wait_for(sup.failed.wait(), 1.0)
        await sup.close()
        return sup.failure

    failure = asyncio.run(main())
    assert "watch-nodes" in failure and "RuntimeError: etcd went away" in failure


def test_a_long_lived_task_that_returns_is_a_failure() -> None:
    async def main() -> str:
        sup = TaskSupervisor()
        sup.spawn(asyncio.sleep(0), "leader-loop")
        await asyncio.wait_for(sup.failed.wait(), 1.0)
        await sup.close()
        return sup.failure

    assert asyncio.run(main()) == "task leader-loop returned unexpectedly"


def test_a_short_task_may_return_but_not_raise() -> None:
    async def bad() -> None:
        raise ValueError("bad request")

    async def main() -> tuple[bool, str]:
        sup = TaskSupervisor()
        await sup.spawn(asyncio.sleep(0, result=3), "probe", long_lived=False)
        await _settle()
        ok = not sup.failed.is_set()
        task = sup.spawn(bad(), "reply", long_lived=False)
        with pytest.raises(ValueError):
            await task
        await _settle()
        await sup.close()
        return ok, sup.failure

    ok, failure = asyncio.run(main())
    assert ok
    assert failure == "task reply failed: ValueError: bad request"


def test_the_first_failure_is_kept() -> None:
    async def fail(message: str, delay: int) -> None:
        for _ in range(delay):
            await asyncio.sleep(0)
        raise RuntimeError(message)

    async def main() -> str:
        sup = TaskSupervisor()
        sup.spawn(fail("second", 5), "b")
        sup.spawn(fail("first", 1), "a")
        await _settle()
        await _settle()
        await sup.close()
        return sup.failure

    assert asyncio.run(main()) == "task a failed: RuntimeError: first"


def test_close_cancels_every_task_quietly_and_is_idempotent() -> None:
    async def main() -> tuple[list[bool], bool, str]:
        sup = TaskSupervisor()
        tasks = [sup.spawn(asyncio.sleep(3600), f"forever-{i}") for i in range(3)]
        tasks.append(sup.spawn(asyncio.sleep(3600), "short", long_lived=False))
        await _settle()
        await asyncio.wait_for(sup.close(), 1.0)
        await asyncio.wait_for(sup.close(), 1.0)
        return [t.cancelled() for t in tasks], sup.failed.is_set(), sup.failure

    cancelled, failed, failure = asyncio.run(main())
    assert cancelled == [True] * 4
    assert not failed and failure == ""


def test_close_waits_for_a_task_that_cleans_up() -> None:
    cleaned: list[str] = []

    async def worker() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0)
            cleaned.append("done")

    async def main() -> None:
        sup = TaskSupervisor()
        sup.spawn(worker(), "worker")
        await _settle()
        await asyncio.wait_for(sup.close(), 1.0)

    asyncio.run(main())
    assert cleaned == ["done"]


def test_close_ends_a_task_that_swallowed_its_cancellation() -> None:
    # What Python 3.11's asyncio.wait_for does when a cancellation meets its inner wait's
    # completion: the CancelledError is lost and the loop goes on to wait for something else.
    swallowed: list[str] = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append("once")
        await asyncio.Event().wait()  # forever, unless cancelled again

    async def main() -> bool:
        sup = TaskSupervisor()
        task = sup.spawn(stubborn(), "stubborn")
        await _settle()
        await sup.close()
        return task.cancelled()

    assert asyncio.run(main())
    assert swallowed == ["once"]
