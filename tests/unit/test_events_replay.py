"""`ultractl events` replays etcd's history of the job's keys: a progress notification that
etcd (before 3.5.8) sends ahead of the history must not end the replay empty."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from daemon.api.events import history
from daemon.control.etcd_client import PUT
from daemon.control.keys import Keys
from daemon.control.records import Directive

pytestmark = pytest.mark.unit
KEYS = Keys("job")


def _response(events: list, revision: int, created: bool = False) -> SimpleNamespace:
    return SimpleNamespace(events=events, created=created,
                           header=SimpleNamespace(revision=revision))


def _directive(generation: int, revision: int) -> SimpleNamespace:
    kv = SimpleNamespace(key=KEYS.directive, value=Directive(generation=generation).to_json(),
                         mod_revision=revision)
    return SimpleNamespace(kv=kv, type=PUT, prev_kv=SimpleNamespace(key=b""))


class _Etcd:
    """A watch from the past as etcd 3.5.1 may answer it: created, then a progress
    notification at the current revision, then the history."""

    async def get_prefix(self, prefix: bytes):
        return [], 8

    async def watch(self, key: bytes, **options):
        yield _response([], 8, created=True)
        yield _response([], 8)  # ahead of the events it should follow
        yield _response([_directive(1, 3), _directive(2, 8)], 8)
        yield _response([], 8)  # caught up, for real


def test_a_progress_notification_ahead_of_the_history_does_not_end_the_replay():
    async def replay() -> list[int]:
        return [e.generation async for e in history(_Etcd(), KEYS, follow=False)]  # type: ignore

    assert asyncio.run(replay()) == [1, 2]
