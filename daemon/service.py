"""`ultrad` as a service: signals, the drain on SIGTERM, and systemd's notify protocol.

SIGTERM is what systemd and Kubernetes send to stop a node, so it means *drain*: an agent
whose workers train in the current generation asks for its own drain through etcd, exactly as
`ultractl drain` does; the running generation stops at the next step boundary the ranks agree
on, after a durable checkpoint, and the leader re-plans without this node. Then the agent
exits 0. An agent that is not in a running job (waiting, control plane only, the job finished
or not yet past its first step) has nothing to save and exits at once. A second SIGTERM, or
SIGINT at any time, stops at once. SIGHUP is logged and ignored: the agent reads its flags,
config file, token and TLS files only at start, and a half-applied reload (a new token on one
listener, the old certificate on another) would be worse than none; a restart applies a
change. docs/systemd.md has the whole protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from daemon.agent import Agent
from daemon.config import AgentConfig
from daemon.control.decide import boundary_timeout
from daemon.control.etcd_client import ETCD_ERRORS
from daemon.control.records import ENDED, ControlOp, ControlRequest, JobState, NodeState
from daemon.liveness import LoopWatchdog
from daemon.sdnotify import Notifier
from daemon.tasks import Backoff

log = logging.getLogger(__name__)

_ENDED = ENDED


class Service:
    def __init__(self, config: AgentConfig, notifier: Notifier | None = None) -> None:
        self.agent = Agent(config)
        self.notifier = notifier if notifier is not None else Notifier.from_env(os.environ)
        self._draining = False
        self._watchdog: LoopWatchdog | None = None

    async def run(self) -> int:
        agent, notify = self.agent, self.notifier
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        loop.add_signal_handler(signal.SIGINT, self._stop_now, "SIGINT")
        # Its default action would end the agent without a drain (a closed terminal sends it).
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        agent.state.subscribe(lambda old, new, reason: notify.status(f"{new.value}: {reason}"))
        if notify.watchdog_s > 0:
            # Half the period, as sd_watchdog_enabled(3) recommends: one late ping is not fatal.
            self._watchdog = LoopWatchdog(loop, lambda: not agent.tasks.failed.is_set(),
                                          notify.watchdog, notify.watchdog_s / 2)
            self._watchdog.start()
        try:
            await agent.start()
            if notify.enabled:
                agent.tasks.spawn(self._ready(), "sd-ready", long_lived=False)
            code = await agent.serve_forever()
            notify.stopping(f"stopping (exit {code})")
            return code
        finally:
            await agent.stop()
            if self._watchdog is not None:
                self._watchdog.stop()
            log.info("stopped")

    async def _ready(self) -> None:
        """READY=1 once the agent listens (start() returned) and holds its lease."""
        assert self.agent.membership is not None
        await self.agent.membership.joined.wait()
        self.notifier.ready(f"{self.agent.state.state.value}: holds lease "
                            f"{self.agent.membership.lease_id:x}")

    # -- signals ---------------------------------------------------------------------------------

    def _stop_now(self, why: str) -> None:
        log.info("%s: stopping now", why)
        self.notifier.stopping(f"stopping: {why}")
        self.agent.stopping.set()

    @staticmethod
    def _on_sighup() -> None:
        log.warning("SIGHUP ignored: ultrad reads its configuration, token and TLS files only "
                    "at start; restart it (systemctl restart ultrad) to apply a change")

    def _on_sigterm(self) -> None:
        if self._draining:
            self._stop_now("second SIGTERM")
            return
        if not self.in_running_job():
            self._stop_now("SIGTERM, not in a running job")
            return
        self._draining = True
        log.info("SIGTERM: draining (leave at the next step boundary, after a checkpoint)")
        self.notifier.stopping("draining: leaving at the next step boundary")
        self.agent.tasks.spawn(self._drain(), "sigterm-drain", long_lived=False)

    def in_running_job(self) -> bool:
        """Our workers train in the current generation, which has committed a step: leaving
        without a drain would lose the steps since the last checkpoint."""
        a = self.agent
        view, plan, p = a.view, a.view.plan, a.view.progress
        return a.node.supervisor is not None and bool(a.node.supervisor.alive()) \
            and plan is not None and a.node_id in plan.nodes \
            and p.generation == plan.generation and not (p.finished or p.stopped) \
            and view.status.state not in _ENDED

    # -- the drain -------------------------------------------------------------------------------

    async def _drain(self) -> None:
        a = self.agent
        plan = a.view.plan
        fault = plan.job.fault if plan is not None else None
        # The leader gives a planned stop boundary_timeout before it treats the generation as
        # failed; past that (plus the time to notice) waiting longer cannot save anything.
        limit = (boundary_timeout(fault) if fault else 0.0) + 2 * a.config.ttl
        deadline = time.monotonic() + limit
        await self._request_drain(deadline)
        reason = None
        while reason is None and time.monotonic() < deadline:
            await a.view.wait_for(lambda: self.drained() is not None,
                                  timeout=min(1.0, a.config.ttl))
            reason = self.drained()
        if reason is None:
            log.warning("drain did not complete within %.0fs; stopping anyway", limit)
            reason = "drain timed out"
        log.info("drained: %s", reason)
        self.notifier.stopping(f"drained: {reason}")
        a.stopping.set()

    async def _request_drain(self, deadline: float) -> None:
        """The same request `ultractl drain` writes; this agent's follower applies it."""
        a = self.agent
        request = ControlRequest(op=ControlOp.DRAIN, node=a.node_id, time=time.time())
        backoff = Backoff(initial=0.1, maximum=a.config.ttl / 2)
        while time.monotonic() < deadline:
            try:
                await a.etcd.put(a.keys.control_request(f"drain-{a.node_id}-sigterm"),
                                 request.to_json())
                return
            except ETCD_ERRORS as exc:
                log.warning("drain request not recorded yet (%s); retrying", type(exc).__name__)
                await backoff.sleep()

    def drained(self) -> str | None:
        """Why this agent may leave now, or None while its drain is under way."""
        a = self.agent
        view, plan, p = a.view, a.view.plan, a.view.progress
        if view.status.state in _ENDED:
            return f"job {view.status.state.value}"
        if plan is None:
            return "no generation"
        m = a.membership
        if m is None or m.record.state != NodeState.DRAINING:
            return None  # our drain request is not applied yet
        leading = view.leader_node == a.node_id
        if a.node_id in plan.nodes:
            stopped = p.generation == plan.generation and (p.stopped or p.finished)
            # A leader stays while it may still write the next generation (and host its store).
            if stopped and (not leading or view.status.state == JobState.PENDING):
                return f"generation {plan.generation} stopped at step {p.step}"
            return None
        if leading and p.generation != plan.generation:
            return None  # the new generation rendezvouses at our store: wait for its first step
        return f"not in generation {plan.generation}"
