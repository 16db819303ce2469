"""torch's `RendezvousBackend` on etcd v3: the rendezvous state in one key, written
compare-and-set on that key's mod revision (the fencing token torch hands back).

torch's DynamicRendezvousHandler does the rendezvous itself (rounds, min:max nodes, last call,
keep-alive heartbeats, closing); what it asks of a backend is exactly this: read the state and
its token, and write a new state only if the token is still current, else answer with the state
that won. Each write also puts the state's readable summary (`rendezvous/round`) in the same
txn, for `ultractl events`, so nothing but torchrun ever unpickles the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from daemon.control.etcd_sync import SyncEtcd
from daemon.control.keys import Keys
from daemon.rendezvous.retry import EtcdSilent, Retry
from daemon.rendezvous.state_check import UnsafeState, load_state, summarise

BACKEND_NAME = "ultrascale"
T = TypeVar("T")


class EtcdRendezvousBackend(RendezvousBackend):
    def __init__(self, etcd: SyncEtcd, keys: Keys, min_nodes: int, max_nodes: int,
                 retry: Retry | None = None) -> None:
        self._etcd = etcd
        self._keys = keys
        self._min_nodes = min_nodes
        self._max_nodes = max_nodes
        self._retry = retry or Retry()

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        kv = self._call(lambda: self._etcd.get(self._keys.rendezvous_state))
        if kv is None:
            return None
        self._check(kv.value)
        return kv.value, kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        key, tx = self._keys.rendezvous_state, self._etcd.tx
        if token is None:
            compare = [tx.create(key) == 0]
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            compare = [tx.mod(key) == token]
        else:  # not a token of ours: it cannot match
            held = self.get_state()
            return None if held is None else (*held, False)
        try:
            summary = summarise(load_state(state), self._min_nodes, self._max_nodes)
        except UnsafeState as exc:
            raise RendezvousStateError(f"refusing to write a rendezvous state: {exc}") from None
        ok, responses = self._call(lambda: self._etcd.txn(
            compare, [tx.put(key, state), tx.put(self._keys.rendezvous_round,
                                                 summary.to_json())],
            [tx.get(key)]))
        if ok:
            # Both puts are at the txn's revision: the state's new mod revision.
            return state, int(responses[0].response_put.header.revision), True
        held = responses[0][0][1] if responses and responses[0] else None
        if held is None:
            return None  # a token was given, but the state is gone (deleted by hand)
        self._check(held.value)
        return held.value, int(held.mod_revision), False

    def _check(self, data: bytes) -> None:
        try:
            load_state(data)
        except UnsafeState as exc:
            raise RendezvousStateError(
                f"the rendezvous state in etcd ({self._keys.rendezvous_state.decode()}) is not "
                f"one torch wrote: {exc}") from None

    def _call(self, fn: Callable[[], T]) -> T:
        """`fn()`, retried while etcd does not answer. A txn whose answer was lost may have
        been applied; sending it again is safe: its compare fails and the state that won
        (ours) comes back, which torch re-reads."""
        try:
            return self._retry.call(fn)
        except EtcdSilent as exc:
            raise RendezvousConnectionError(
                f"{exc} ({self._etcd.etcd.client.endpoint.url})") from exc
