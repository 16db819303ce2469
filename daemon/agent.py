"""One node's agent: wires the control plane, this node's workers and the API together.

Everything runs on one asyncio loop and every long-lived task is supervised (tasks.py): an
unexpected exception ends the agent non-zero rather than leaving a silent, leaderless stall.
The agent never runs collectives. Its state machine (state.py) follows the generations:
joining → waiting | running → reconfiguring → … → draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from daemon import __version__
from daemon.api.admin_service import AdminContext
from daemon.api.advertise import worker_network_env
from daemon.api.probes import agent_probes
from daemon.api.servers import AgentIO
from daemon.config import AgentConfig
from daemon.control.election import Election
from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.job_state import job_state
from daemon.control.job_submit import offer_job_file
from daemon.control.keys import Keys
from daemon.control.leader import Leader
from daemon.control.leadership import lead_when_elected
from daemon.control.membership import Membership
from daemon.control.node_requests import apply_node_requests
from daemon.control.outage import outage_check, publish_etcd_health
from daemon.control.peer_key import PeerKeys
from daemon.control.records import NodeRecord, NodeState
from daemon.control.store_host import StoreHost
from daemon.control.view import ClusterView
from daemon.metrics import Metrics
from daemon.node.progress import ProgressWriter
from daemon.node.snapshot_files import check_room
from daemon.node.snapshot_keeper import SnapshotKeeper
from daemon.node.workers import NodeWorkers
from daemon.recovery_phases import RecoveryPhases
from daemon.state import AgentState, StateMachine
from daemon.tasks import TaskSupervisor

log = logging.getLogger(__name__)


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.devices = config.devices
        self.keys = Keys(config.job)
        self.metrics = Metrics()
        self.etcd = Etcd(config.etcd, timeout=max(1.0, config.ttl / 2),
                         security=config.etcd_security)
        self.view = ClusterView(self.etcd, self.keys)
        self.election = Election(self.etcd, self.keys, self.node_id)
        self.state = StateMachine()
        self.tasks = TaskSupervisor()
        self.io = AgentIO(config, self.metrics)
        self.stopping = asyncio.Event()
        self.membership: Membership | None = None
        self.leader: Leader | None = None
        self.progress = ProgressWriter(self.etcd, self.keys, self.view)
        self._follow = asyncio.Event()
        self._seen_generation = 0
        self.recovery = RecoveryPhases()  # the recovery in progress, if any, split in phases
        self.peer_keys = PeerKeys(self.etcd, self.keys, self.view)
        self.snapshots = SnapshotKeeper.for_agent(
            config, self.view, self.etcd, self.keys, self.io.put_snapshot_file,
            lambda: self.membership.lease_id if self.membership is not None else 0,
            self.metrics.observe_snapshots, self.peer_keys.current)
        self.node = NodeWorkers(config, self.view, self.etcd, self.keys, self.metrics,
                                self.progress, self.recovery, self.snapshots,
                                self.io.read_snapshot, self.io.probe, self._draining,
                                self.stopping, self.tasks)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        if self.snapshots is not None:
            self.snapshots.clear()  # what a previous run left is no one's to restore from
        admin = AdminContext(self.node_id, cfg, self.view, self.etcd, self.keys, self.state)
        probes = agent_probes(self.node_id, self.view, self.tasks, self.stopping,
                              lambda: self.membership is not None
                              and self.membership.joined.is_set())
        await self.io.start(admin, probes, self.node, self.snapshots, self.peer_keys.secret)
        self.leader = Leader(self.etcd, self.keys, self.view, self.election,
                             StoreHost(self.io.advertised_host), cfg.ttl, cfg.debounce_s,
                             self.io.probe, self.io.snapshot_holdings)
        watchdog = self.node.start(self.io.socket_path, worker_network_env(
            self.io.advertised_host, dict(os.environ)) | SnapshotKeeper.env(self.snapshots)
            | self.io.worker_env())
        record = NodeRecord(self.node_id, self.io.address, self.io.metrics_url, cfg.devices,
                            pid=self.io.pid, version=__version__, device_memory=cfg.device_memory)
        self.membership = Membership(
            self.etcd, self.keys, record, cfg.ttl, self._on_fenced,
            lambda: outage_check(self.io, [(name, m.record.address)
                                           for name, m in self.view.nodes.items()
                                           if name != self.node_id]),
            cfg.etcd_outage_s)
        self.view.subscribe(self._on_view)
        await self.etcd.connect()
        spawn = self.tasks.spawn
        if cfg.workers:
            # A leader hosts c10d stores: start their process (and its import of torch) now,
            # not in the first generation change; control-plane-only agents start it when
            # they first lead.
            self.leader.store.preload()
        spawn(self.view.run(), "view")
        spawn(self.peer_keys.run(), "peer-key")
        spawn(self.membership.run(), "membership")
        spawn(lead_when_elected(self.node_id, self.membership, self.view, self.election,
                                self.leader, cfg.ttl, lambda on: self.metrics.is_leader.set(int(on))),
              "leadership")
        spawn(self._follower(), "follower")
        spawn(self.progress.run(), "progress")
        if self.snapshots is not None:
            self.snapshots.address = self.io.address
            spawn(self.snapshots.run(), "snapshots")
        spawn(publish_etcd_health(
            self.io, lambda: self.membership is not None and self.membership.etcd_ok),
            "etcd-health")
        if cfg.job_file is not None:
            spawn(offer_job_file(self.etcd, self.keys, cfg.job_file, cfg.ttl, cfg.job_roots),
                  "job-file", long_lived=False)
        if watchdog is not None:
            spawn(watchdog.run(), "watchdog")
        self.io.write_agent_file(self.node_id)
        log.info("agent %s up: grpc %s, metrics %s, %d device(s), etcd %s, job namespace %s",
                 self.node_id, self.io.address, self.io.metrics_url, cfg.devices, cfg.etcd,
                 cfg.job)

    async def serve_forever(self) -> int:
        """Until asked to stop (0) or until a supervised task fails (1)."""
        stop = asyncio.ensure_future(self.stopping.wait())
        failed = asyncio.ensure_future(self.tasks.failed.wait())
        await asyncio.wait([stop, failed], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        failed.cancel()
        if self.tasks.failed.is_set():
            log.error("stopping: %s", self.tasks.failure)
            return 1
        return 0

    async def stop(self) -> None:
        """Leave cleanly: workers first, then the lease (peers re-plan at once), then servers.
        Safe after a partial start and when called twice."""
        self.stopping.set()
        self.tasks.closing()
        await self.node.stop(grace=self.config.ttl)
        if self.membership is not None:
            await self.io.leaving()  # a peer's probe after the revoke must not find us alive
            await self.membership.leave()
        await self.tasks.close()
        await self.io.stop()
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.leader is not None:
            self.leader.store.close()
        with contextlib.suppress(*ETCD_ERRORS):
            await self.etcd.close()

    def _draining(self) -> bool:
        m = self.membership
        return m is not None and m.record.state == NodeState.DRAINING

    async def _on_fenced(self, reason: str) -> None:
        self.election.drop(f"fenced: {reason}")
        self.metrics.is_leader.set(0)
        self.state.to(AgentState.JOINING, f"fenced: {reason}")
        self._seen_generation = 0
        # the world our workers were in is broken: never hand it out again; tell the leader
        self.node.fenced(reason)
        await self.node.kill_all()

    # -- generations ----------------------------------------------------------------------------

    def _on_view(self, kinds: set[str]) -> None:
        plan, now = self.view.plan, time.monotonic()
        if plan is not None:
            self.recovery.plan_seen(plan.generation, now)
        if "nodes" in kinds and plan is not None and not self.recovery.active \
                and any(n not in self.view.nodes for n in plan.nodes):
            self.recovery.failed(plan.generation, now)
        if kinds & {"spec", "status", "checkpoint"}:
            self.metrics.observe_job(job_state(self.view)[0], self.view.checkpoint)
        self._follow.set()

    async def _follower(self) -> None:
        """Apply this node's admin requests and follow new generations, one change at a time."""
        while True:
            await self._follow.wait()
            self._follow.clear()
            m = self.membership
            if m is None or not m.joined.is_set():
                continue
            if not await apply_node_requests(self.node_id, self.view, m, self.etcd, self.keys):
                self._follow.set()  # etcd failed: again at the next pass
            await self._follow_generation()

    async def _follow_generation(self) -> None:
        assert self.membership is not None
        plan, record = self.view.plan, self.membership.record
        in_plan = plan is not None and self.node_id in plan.nodes
        new = plan is not None and plan.generation != self._seen_generation
        if plan is not None and new:
            self._seen_generation = plan.generation
            self.metrics.observe_plan(plan, self.view.progress)
            if in_plan:
                self.state.to(AgentState.RECONFIGURING, f"generation {plan.generation}")
                if self.snapshots is not None and plan.predicted.snapshot_host_bytes:
                    predicted = plan.predicted.snapshot_host_bytes
                    self.metrics.observe_snapshot_room(predicted, check_room(
                        self.snapshots.root, self.snapshots.bytes_held, predicted))
        await self.node.follow(new_generation=new and in_plan)
        if record.state == NodeState.DRAINING:
            self.state.to(AgentState.DRAINING, "drain requested")
        elif in_plan:
            self.state.to(AgentState.RUNNING, f"in generation {self.view.generation}")
        else:
            self.state.to(AgentState.WAITING, "not in the current generation"
                          if plan is not None else "no generation yet")
