"""torch's rendezvous state as read from etcd: checked before torch unpickles it, and summarised
for readers (records.RendezvousRound).

torch keeps its dynamic rendezvous state as a pickle and unpickles whatever the backend hands
it. A pickle can name and call any function, so anyone who could write the state key could run
code in every torchrun agent. The backend therefore hands torch only a state that this module
could load while resolving nothing but the classes the state is made of (the "Restricting
Globals" recipe of Python's pickle documentation); anything else is a corrupt state.
"""

from __future__ import annotations

import datetime
import io
import pickle
import time
from types import MappingProxyType
from typing import Any

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from daemon.control.records import RendezvousRound


class UnsafeState(ValueError):
    """The bytes are not a plain torch rendezvous state."""


_ALLOWED = MappingProxyType({
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"):
        dyn._RendezvousState,  # noqa: SLF001 - the class torch pickles
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"):
        dyn._NodeDesc,  # noqa: SLF001
    # heartbeats and deadlines: aware datetimes in UTC
    ("datetime", "datetime"): datetime.datetime,
    ("datetime", "timezone"): datetime.timezone,
    ("datetime", "timedelta"): datetime.timedelta,
})


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise UnsafeState(f"the state names {module}.{name}, which a rendezvous state "
                              "never holds")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeState("the state refers to a persistent object")


def load_state(data: bytes) -> Any:
    """torch's `_RendezvousState` from `data`, resolving only the classes it is made of."""
    try:
        state = _Restricted(io.BytesIO(data)).load()
    except UnsafeState:
        raise
    except Exception as exc:  # noqa: BLE001 - anything a malformed pickle raises
        raise UnsafeState(f"not a rendezvous state ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from None
    if not isinstance(state, dyn._RendezvousState):  # noqa: SLF001
        raise UnsafeState(f"it holds a {type(state).__name__}, not a rendezvous state")
    return state


def _name(node: Any) -> str:
    return f"{node.addr}_{node.pid}_{node.local_id}"


def summarise(state: Any, min_nodes: int, max_nodes: int) -> RendezvousRound:
    """The readable record of a loaded state."""
    ranked = sorted(state.participants.items(), key=lambda item: item[1])
    return RendezvousRound(
        round=int(state.round), complete=bool(state.complete), closed=bool(state.closed),
        participants=tuple(_name(node) for node, _ in ranked),
        waiting=tuple(sorted(_name(n) for n in state.wait_list)),
        redundant=tuple(sorted(_name(n) for n in state.redundancy_list)),
        min_nodes=min_nodes, max_nodes=max_nodes, time=time.time())
