"""This node's failure reports to the leader: each a `failure` control request, put until etcd
acknowledges it or a newer generation makes it moot; and, once per broken generation that a
peer broke, the check that the leader's agent is alive (daemon/control/leader_failover.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.keys import Keys
from daemon.control.leader_failover import Probe, revoke_dead_leader
from daemon.control.records import ControlOp, ControlRequest, FailureKind
from daemon.control.view import ClusterView
from daemon.tasks import Backoff, TaskSupervisor

log = logging.getLogger(__name__)


class FailureReports:
    def __init__(self, node: str, etcd: Etcd, keys: Keys, view: ClusterView,
                 tasks: TaskSupervisor, stopping: asyncio.Event, probe: Probe) -> None:
        self.node, self.etcd, self.keys, self.view = node, etcd, keys, view
        self.tasks, self.stopping, self.probe = tasks, stopping, probe
        self._leader_checked = 0  # the newest generation a failure made us check the leader in

    def report(self, request_id: str, generation: int, kind: FailureKind, step: int,
               message: str, stacks: str = "") -> None:
        """Report a failure of `generation` to the leader, in the background."""
        request = ControlRequest(op=ControlOp.FAILURE, node=self.node, generation=generation,
                                 kind=kind, step=step, message=message[:2000], time=time.time(),
                                 stacks=stacks[-4096:])
        self.tasks.spawn(put_until_acknowledged(
            self.etcd, self.keys.control_request(request_id), request,
            lambda: self.view.generation <= generation and not self.stopping.is_set()),
            f"report-{request_id}", long_lived=False)
        if kind == FailureKind.PEER and self._leader_checked < generation:
            self._leader_checked = generation  # once per broken generation
            self.tasks.spawn(revoke_dead_leader(self.view, self.etcd, self.keys, self.probe,
                                                self.node), "leader-check", long_lived=False)


async def put_until_acknowledged(etcd: Etcd, key: bytes, request: ControlRequest,
                                 still_wanted: Callable[[], bool]) -> None:
    """Put `request`, retried until etcd acknowledges it or `still_wanted()` turns false."""
    backoff = Backoff(initial=0.1, maximum=2.0)
    while still_wanted():
        try:
            await etcd.put(key, request.to_json())
            return
        except ETCD_ERRORS as exc:
            log.warning("request %s not recorded yet (%s); retrying", key.decode(errors="replace"),
                        type(exc).__name__)
            await backoff.sleep()
