"""`ultractl events` renders plain torchrun's rendezvous rounds from the `rendezvous/round`
record (daemon/api/events.py); heartbeats, which rewrite the same summary, are not events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from daemon.api.events import render
from daemon.control.etcd_client import PUT
from daemon.control.keys import Keys
from daemon.control.records import RendezvousRound

pytestmark = pytest.mark.unit
KEYS = Keys("run-42")


def _event(record: RendezvousRound, before: RendezvousRound | None, revision: int):
    kv = SimpleNamespace(key=KEYS.rendezvous_round, value=record.to_json(),
                         mod_revision=revision)
    prev = (SimpleNamespace(key=KEYS.rendezvous_round, value=before.to_json()) if before
            else SimpleNamespace(key=b"", value=b""))
    return SimpleNamespace(kv=kv, type=PUT, prev_kv=prev)


def messages(*records: RendezvousRound) -> list[str | None]:
    out, before = [], None
    for revision, record in enumerate(records, start=2):
        ev = render(KEYS, _event(record, before, revision))
        out.append(None if ev is None else f"{ev.kind} {ev.generation}: {ev.message}")
        before = record
    return out


def test_a_round_that_completes_loses_a_node_and_closes() -> None:
    a, b = "host-a_10_0", "host-b_11_0"
    joined = RendezvousRound(round=0, participants=(a,), min_nodes=2, max_nodes=2, time=1.0)
    complete = RendezvousRound(round=0, complete=True, participants=(a, b), min_nodes=2,
                               max_nodes=2, time=2.0)
    heartbeat = RendezvousRound(round=0, complete=True, participants=(a, b), min_nodes=2,
                                max_nodes=2, time=3.0)
    left = RendezvousRound(round=0, complete=True, participants=(b,), min_nodes=2, max_nodes=2)
    waiting = RendezvousRound(round=0, complete=True, participants=(b,), waiting=(a,),
                              min_nodes=2, max_nodes=2)
    closed = RendezvousRound(round=1, complete=True, closed=True, participants=(a, b))
    assert messages(joined, complete, heartbeat, left, waiting, closed) == [
        "rendezvous 0: rendezvous round 0: 1 node of 2:2 joined",
        f"rendezvous 0: rendezvous round 0 complete: 2 nodes ({a}, {b})",
        None,
        f"rendezvous 0: rendezvous round 0: {a} left (1 remaining)",
        f"rendezvous 0: rendezvous round 0 complete: 1 node ({b}); waiting for the next "
        f"round: {a}",
        "rendezvous 1: rendezvous closed (round 1)",
    ]
