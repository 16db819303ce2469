"""The torchrun rendezvous backend's compare-and-set and its c10d store, against a real etcd
(daemon/rendezvous/backend.py, store.py)."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from daemon.control.etcd_server import EtcdServer
from daemon.control.etcd_sync import SyncEtcd
from daemon.control.keys import Keys
from daemon.control.records import RendezvousRound
from daemon.rendezvous.backend import EtcdRendezvousBackend
from daemon.rendezvous.store import EtcdStore

pytestmark = pytest.mark.integration
KEYS = Keys("cas-run")


@pytest.fixture
def clients(etcd: EtcdServer) -> Iterator[list[SyncEtcd]]:
    """Two independent clients, as two torchrun agents have."""
    made = [SyncEtcd(etcd.endpoint), SyncEtcd(etcd.endpoint)]
    try:
        yield made
    finally:
        for client in made:
            client.close()


def state(round_: int, *nodes: str) -> bytes:
    s = _RendezvousState()
    s.round = round_
    s.participants = {_NodeDesc(n, 100 + i, 0): i for i, n in enumerate(nodes)}
    return pickle.dumps(s)


def round_of(data: bytes) -> int:
    return pickle.loads(data).round


def test_compare_and_set_on_the_mod_revision(clients: list[SyncEtcd]) -> None:
    a, b = (EtcdRendezvousBackend(c, KEYS, 1, 2) for c in clients)
    assert a.get_state() is None
    # No token: only the first writer creates the state; the second gets the winner's.
    first = a.set_state(state(1, "h1"))
    assert first is not None and first[2] and round_of(first[0]) == 1
    lost = b.set_state(state(7, "h2"))
    assert lost == (first[0], first[1], False)
    # The current token wins; a stale one loses and answers with the state that won.
    won = b.set_state(state(2, "h1", "h2"), first[1])
    assert won is not None and won[2] and won[1] > first[1]
    stale = a.set_state(state(9), first[1])
    assert stale == (won[0], won[1], False)
    assert a.get_state() == (won[0], won[1])
    # A token that is not ours can never match, and nothing is written.
    assert a.set_state(state(5), b"foreign") == (won[0], won[1], False)
    # The readable summary is written in the same txn: participants in rank order.
    kv = clients[0].get(KEYS.rendezvous_round)
    assert kv is not None and kv.mod_revision == won[1]
    summary = RendezvousRound.from_json(kv.value)
    assert (summary.round, summary.min_nodes, summary.max_nodes) == (2, 1, 2)
    assert summary.participants == ("h1_100_0", "h2_101_0")


def test_concurrent_writers_lose_no_update(clients: list[SyncEtcd]) -> None:
    """torch's state holder loop: read, change, write with the token, re-read on a loss."""
    backends = [EtcdRendezvousBackend(c, KEYS, 1, 2) for c in clients for _ in range(2)]
    per_writer = 15

    def bump(backend: EtcdRendezvousBackend) -> None:
        for _ in range(per_writer):
            held = backend.get_state()
            while True:
                current, token = (round_of(held[0]), held[1]) if held else (0, None)
                answer = backend.set_state(state(current + 1), token)
                assert answer is not None
                if answer[2]:
                    break
                held = (answer[0], answer[1])

    threads = [threading.Thread(target=bump, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    held = backends[0].get_state()
    assert held is not None and round_of(held[0]) == per_writer * len(backends)


class _Touch:
    """A pickle that, if unpickled with pickle's defaults, creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.touch, (self.path,))


def test_a_forged_state_is_never_unpickled(clients: list[SyncEtcd], tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    clients[0].put(KEYS.rendezvous_state, pickle.dumps(_Touch(marker)))
    backend = EtcdRendezvousBackend(clients[1], KEYS, 1, 2)
    with pytest.raises(RendezvousStateError, match="pathlib"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(state(1), None)  # loses the create, reads the forged state
    assert not marker.exists()
    # A state of torch's own classes holding a forged object is refused too.
    s = _RendezvousState()
    s.participants = {_Touch(marker): 0}  # type: ignore[dict-item]
    with pytest.raises(RendezvousStateError):
        backend.set_state(pickle.dumps(s))
    assert not marker.exists()


def test_store_get_waits_for_a_set(clients: list[SyncEtcd]) -> None:
    writer = EtcdStore(clients[0], KEYS.rendezvous_store)
    # The Python store must outlive the PrefixStore (torch's handler holds it, as here).
    store = EtcdStore(clients[1], KEYS.rendezvous_store, timeout=timedelta(seconds=20))
    reader = dist.PrefixStore("round.0", store)
    timer = threading.Timer(0.5, lambda: writer.set("round.0/MASTER_ADDR", "10.0.0.1"))
    timer.start()
    began = time.monotonic()
    assert reader.get("MASTER_ADDR") == b"10.0.0.1"
    assert 0.4 < time.monotonic() - began < 10
    assert reader.check(["MASTER_ADDR"]) and not reader.check(["MASTER_PORT"])
    reader.multi_set(["a", "b"], ["1", "2"])
    assert reader.multi_get(["a", "b"]) == [b"1", b"2"]
    began = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="MASTER_PORT"):
        reader.wait(["MASTER_PORT"], timedelta(seconds=1))
    assert 0.9 < time.monotonic() - began < 8


def test_store_add_and_compare_set_are_atomic(clients: list[SyncEtcd]) -> None:
    stores = [EtcdStore(c, KEYS.rendezvous_store) for c in clients for _ in range(2)]
    threads = [threading.Thread(target=lambda s=s: [s.add("members", 1) for _ in range(10)])
               for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert stores[0].add("members", 0) == 40
    s = stores[0]
    # c10d's semantics: an absent key is set only when the expected value is empty.
    assert s.compare_set("flag", "x", "y") == b"x" and not s.check(["flag"])
    assert s.compare_set("flag", "", "on") == b"on"
    assert s.compare_set("flag", "off", "again") == b"on"
    assert s.compare_set("flag", "on", "off") == b"off"
    assert s.num_keys() == 2
    assert s.delete_key("flag") and not s.check(["flag"])


def test_calls_wait_out_an_etcd_restart(etcd: EtcdServer, clients: list[SyncEtcd]) -> None:
    """A rendezvous read and a store read that begin while etcd is down finish once it is back.
    (etcd is restarted from this thread: it dies with the thread that started it.)"""
    backend = EtcdRendezvousBackend(clients[0], KEYS, 1, 2)
    first = backend.set_state(state(1))
    assert first is not None
    store = EtcdStore(clients[1], KEYS.rendezvous_store, timeout=timedelta(seconds=30))
    got: dict[str, object] = {}
    readers = [threading.Thread(target=lambda: got.update(state=backend.get_state())),
               threading.Thread(target=lambda: got.update(port=store.get("MASTER_PORT")))]
    etcd.kill()
    for t in readers:
        t.start()
    time.sleep(1.5)
    assert not got  # nothing answered while etcd was down
    etcd.start()
    EtcdStore(clients[0], KEYS.rendezvous_store).set("MASTER_PORT", "29500")
    for t in readers:
        t.join(30)
    assert got == {"state": (first[0], first[1]), "port": b"29500"}
