"""Membership changes, leader failure, fencing and etcd restarts, with real agents and etcd."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import pytest

from daemon.control.election import Election, FencedConflict, NotLeader
from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.keys import Keys
from daemon.control.leader import Leader
from daemon.control.membership import Membership
from daemon.control.records import ControlOp, ControlRequest, Directive, NodeRecord
from daemon.control.store_host import StoreHost
from daemon.control.view import ClusterView
from parallel import job as jobmod
from parallel.planner import NodeInfo, plan_generation
from tests.integration.conftest import TINY_JOB, TTL, Cluster, wait_until

pytestmark = pytest.mark.integration


def _generation_history(c: Cluster) -> list[int]:
    """Every value ever written to the generation key, from etcd's revision history."""
    from tests.integration.conftest import etcd_call

    key = f"/ultrascale/{c.job_ns}/generation".encode()

    async def history(e: Etcd) -> list[int]:
        _, until = await e.get_prefix(key)
        numbers: list[int] = []
        async for resp in e.watch(key, start_revision=1, progress_every=0.1):
            numbers += [json.loads(ev.kv.value)["generation"] for ev in resp.events]
            if not resp.events and not resp.created and resp.header.revision >= until:
                return numbers
        return numbers

    return etcd_call(c.etcd.endpoint, history)


def _assert_generations_unique(c: Cluster) -> list[int]:
    numbers = _generation_history(c)
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    return numbers


def test_membership_changes_make_generations(cluster: Cluster) -> None:
    for node in ("a", "b", "c"):
        cluster.start(node)
    cluster.submit(TINY_JOB)
    wait_until(lambda: cluster.status().world_size == 3, 20, "world 3")
    leader = cluster.status().leader
    victim = next(n for n in ("a", "b", "c") if n != leader)
    cluster.kill(victim)
    survivor = next(n for n in ("a", "b", "c") if n not in (victim,))

    def ranks_without_victim() -> dict | None:
        plan = cluster.plan(survivor)
        return None if victim in {r["node"] for r in plan["ranks"]} else plan

    # The lease lapses after one TTL; 3 TTLs bound detection plus planning on a loaded machine
    # (how fast it is, is measured by bench.recovery and the chaos suite, not asserted here).
    plan = wait_until(ranks_without_victim, 3 * TTL, f"a plan without {victim}")
    assert len(plan["ranks"]) == 2 and plan["reason"] == "leave", plan
    # Not always generation 2: under load an agent can register after the first plan, and
    # its join is a generation of its own.
    leave_generation = plan["generation"]
    cluster.start("d", devices=2)
    wait_until(lambda: cluster.status(survivor).world_size == 4, 10, "world 4 after join")
    plan = cluster.plan("d")
    assert [(r["node"], r["local_rank"], r["global_rank"]) for r in plan["ranks"]] == [
        (n, lr, i) for i, (n, lr) in enumerate(
            [(n, 0) for n in sorted({"a", "b", "c"} - {victim})] + [("d", 0), ("d", 1)])]
    assert plan["reason"] == "join"
    # Drain: the next plan leaves the node out; uncordon brings it back.
    result = cluster.ctl("drain", "d", node=survivor)
    assert result.returncode == 0 and "draining" in result.stdout, result.stderr
    wait_until(lambda: cluster.status(survivor).world_size == 2, 10, "world 2 after drain")
    assert cluster.plan()["reason"] == "drain"
    wait_until(lambda: cluster.status("d").agent_state == "draining", 5, "d draining")
    nodes = json.loads(cluster.ctl("-o", "json", "nodes").stdout)
    assert {n["node"]: n["state"] for n in nodes}["d"] == "draining"
    assert cluster.ctl("uncordon", "d").returncode == 0
    wait_until(lambda: cluster.status().world_size == 4, 10, "world 4 after uncordon")
    # Cordon keeps a running node (as kubectl does) but bars it from new generations.
    assert cluster.ctl("cordon", "d").returncode == 0
    time.sleep(1.0)
    assert cluster.status().world_size == 4
    _assert_generations_unique(cluster)
    events = cluster.ctl("events").stdout
    assert "d: ready -> draining" in events, events
    assert f"generation {leave_generation} (leave)" in events, events


def test_leader_killed_another_leads_within_one_ttl(cluster: Cluster) -> None:
    for node in ("a", "b", "c"):
        cluster.start(node)
    cluster.submit(TINY_JOB)
    wait_until(lambda: cluster.status().world_size == 3, 20, "world 3")
    old = cluster.status().leader
    old_generation = cluster.status().generation
    others = [n for n in ("a", "b", "c") if n != old]
    cluster.kill(old)
    t0 = time.monotonic()
    new = wait_until(lambda: (cluster.status(others[0]).leader or None)
                     if cluster.status(others[0]).leader != old else None,
                     3 * TTL, "a new leader", interval=0.02)
    elapsed = time.monotonic() - t0
    assert new in others
    # With no worker in a collective the lease's end is the detection: up to one TTL after the
    # last keepalive, plus etcd's expiry check (every 0.5 s), plus the election and this
    # poll's view of it (0.5 s for a loaded machine; a bound of TTL + 0.5 left them none and
    # once measured 2.72 s).
    assert elapsed <= TTL + 1.0, f"new leader after {elapsed:.2f}s (ttl {TTL}s)"
    wait_until(lambda: cluster.status(others[1]).world_size == 2, 10, "world 2")
    assert cluster.status(others[1]).generation == old_generation + 1
    _assert_generations_unique(cluster)


def test_stale_leader_writes_are_rejected(etcd) -> None:
    """A paused leader whose lease expired wakes up and writes: its old token fails."""
    job = jobmod.loads(TINY_JOB)
    keys = Keys("fence")

    async def scenario() -> None:
        e = Etcd(etcd.endpoint, timeout=2)
        hosts = [StoreHost("127.0.0.1"), StoreHost("127.0.0.1")]
        try:
            old, new = Election(e, keys, "old"), Election(e, keys, "new")
            # Long leases: this test expires the old one explicitly, by revoking it.
            lease_old, lease_new = await e.grant(60), await e.grant(60)
            assert await old.campaign(lease_old)
            assert not await new.campaign(lease_new)
            stale_token = old.token
            view = ClusterView(e, keys)
            task = asyncio.create_task(view.run())
            await asyncio.wait_for(view.synced.wait(), 5)
            leader_old = Leader(e, keys, view, old, hosts[0], TTL, 0.01, _never_probe)
            plan = plan_generation(job, [NodeInfo("old", 1)], 1, ("", 0))
            assert (await leader_old.write_generation(plan, "start")).generation == 1
            await e.revoke(lease_old)  # what etcd does when the lease expires
            assert await new.campaign(lease_new)
            assert new.token > stale_token
            with pytest.raises(NotLeader):
                await leader_old.election.fenced_txn(
                    [], [e.tx.put(keys.generation, b'{"generation": 2}')], token=stale_token)
            old.token = stale_token  # the paused process still believes it leads
            with pytest.raises(NotLeader):
                await leader_old.write_generation(plan, "stale")
            with pytest.raises(NotLeader):
                await leader_old.election.fenced_txn(
                    [], [e.tx.put(keys.directive, Directive(1, stop=True).to_json())])
            assert not old.is_leader
            got = await e.get(keys.generation)
            assert got is not None and json.loads(got.value)["generation"] == 1
            assert await e.get(keys.directive) is None
            # Two writers racing for the same number with a valid token: exactly one wins.
            leader_new = Leader(e, keys, view, new, hosts[1], TTL, 0.01, _never_probe)
            results = await asyncio.gather(leader_new.write_generation(plan, "a"),
                                           leader_new.write_generation(plan, "b"),
                                           return_exceptions=True)
            assert sum(isinstance(r, FencedConflict) for r in results) == 1, results
            task.cancel()
        finally:
            for host in hosts:
                host.close()
            await e.close()

    asyncio.run(scenario())


async def _never_probe(address: str) -> bool:
    return True


def _settle_scenario(etcd, namespace: str, body) -> None:
    """Run `body(leader, view, report)` against a leader of a generation on nodes a, b, c whose
    node b is dead (its probe fails), with a debounce no test waits out."""
    job = jobmod.loads(TINY_JOB)
    keys = Keys(namespace)
    dead_address = "192.0.2.7:1"

    async def probe(address: str) -> bool:
        return address != dead_address

    async def scenario() -> None:
        e = Etcd(etcd.endpoint, timeout=2)
        host = StoreHost("127.0.0.1")
        try:
            election = Election(e, keys, "a")
            lease = await e.grant(60)
            assert await election.campaign(lease)
            for node in ("a", "b", "c"):
                address = dead_address if node == "b" else f"127.0.0.1:{ord(node)}"
                record = NodeRecord(node, address, "", 1)
                await e.put(keys.node(node), record.to_json(), lease=lease)
            view = ClusterView(e, keys)
            task = asyncio.create_task(view.run())
            await asyncio.wait_for(view.synced.wait(), 5)
            # A debounce no test waits out: returning at all means it was cut short.
            leader = Leader(e, keys, view, election, host, TTL, 300.0, probe)
            plan = plan_generation(job, [NodeInfo(n, 1) for n in ("a", "b", "c")], 1, ("", 0))
            await leader.write_generation(plan, "start")
            await view.wait_for(lambda: view.plan is not None, 5)

            async def report(node: str) -> None:
                request = ControlRequest(ControlOp.FAILURE, node, generation=1, step=3)
                await e.put(keys.control_request(f"failure-{node}"), request.to_json())

            await body(leader, view, report)
            task.cancel()
        finally:
            host.close()
            await e.close()

    asyncio.run(scenario())


def test_a_fully_reported_failure_is_decided_without_the_debounce(etcd) -> None:
    """Once every member of a failed generation has reported or does not answer a probe, the
    leader's settling wait ends; while one that answers is still silent, it does not."""

    async def body(leader: Leader, view: ClusterView, report) -> None:
        await report("a")
        # _settle reads the view: one that has not seen the report yet waits for it (and would
        # make this test fail on a slow watch, not on the leader).
        assert await view.wait_for(lambda: leader._reported(1) == {"a"}, 5)
        settling = asyncio.create_task(leader._settle())
        # "c" answers its probe and has not reported: the wait goes on.
        done, _ = await asyncio.wait({settling}, timeout=1.0)
        assert not done
        await report("c")  # "b" is dead (its probe fails): nothing is left to wait for
        await asyncio.wait_for(settling, 10)

    _settle_scenario(etcd, "settle", body)


def test_a_failure_reported_during_a_routine_debounce_cuts_it_short(etcd) -> None:
    """A settling wait begun for other news (rank 0's progress wakes the leader twice a
    second) ends once a failure that arrives during it is fully reported, not after the
    whole debounce."""

    async def body(leader: Leader, view: ClusterView, report) -> None:
        settling = asyncio.create_task(leader._settle())
        done, _ = await asyncio.wait({settling}, timeout=0.5)
        assert not done  # no report yet: a routine wake waits
        await report("a")
        done, _ = await asyncio.wait({settling}, timeout=1.0)
        assert not done  # "c" answers its probe and has not reported
        await report("c")
        await asyncio.wait_for(settling, 10)

    _settle_scenario(etcd, "settle-routine", body)


def test_etcd_killed_and_restarted_agents_rewatch(cluster: Cluster) -> None:
    for node in ("a", "b", "c"):
        cluster.start(node)
    cluster.submit(TINY_JOB)
    wait_until(lambda: cluster.status().world_size == 3, 20, "world 3")
    generation = cluster.status().generation
    cluster.etcd.kill()
    time.sleep(0.5)
    cluster.etcd.start()  # same data dir and ports
    # The agents reconnect (keeping their leases, which etcd restores, or, if the outage
    # outlasted a keepalive deadline, fencing and re-joining), re-watch, and act on changes.
    wait_until(lambda: all(cluster.status(n).nodes == 3 for n in ("a", "b", "c")), 15,
               "all agents members again")
    result = wait_until(lambda: (r := cluster.ctl("drain", "c")).returncode == 0 and r, 10,
                        "drain after the restart")
    assert "draining" in result.stdout
    for node in ("a", "b"):
        wait_until(lambda n=node: cluster.status(n).world_size == 2, 10, f"{node} sees world 2")
        assert cluster.status(node).generation > generation
    assert cluster.status().nodes == 3
    # Killed for longer than a TTL: every agent finds every peer cut off too, so nobody can
    # change membership; they hold on (no fencing, workers would keep training) and re-attach.
    generation = cluster.status("a").generation
    before = {n: len(cluster.agents[n].log) for n in ("a", "b", "c")}
    cluster.etcd.kill()
    time.sleep(TTL + 1.0)
    cluster.etcd.start()
    wait_until(lambda: all(cluster.status(n).nodes == 3 for n in ("a", "b", "c")), 15,
               "all agents re-attached")
    for node in ("a", "b", "c"):
        log = cluster.agents[node].log[before[node]:]
        assert "etcd is unreachable for every peer too" in log, log[-2000:]
        assert "fencing myself" not in log, log[-2000:]
    assert all(cluster.status(n).generation == generation for n in ("a", "b", "c"))
    wait_until(lambda: cluster.status("a").leader != "", 10, "a leader again")
    _assert_generations_unique(cluster)


def test_non_loopback_listen_without_tls_is_refused(tmp_path) -> None:
    import subprocess
    import sys

    from tests.integration.conftest import ROOT

    args = [sys.executable, "-m", "daemon.cli.ultrad", "--etcd", "127.0.0.1:1", "--node-id", "x",
            "--devices", "1", "--listen", "0.0.0.0:0", "--state-dir", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 2 and "--insecure" in result.stderr and "TLS" in result.stderr


def test_sigterm_leaves_at_once(cluster: Cluster) -> None:
    for node in ("a", "b"):
        cluster.start(node)
    cluster.submit(TINY_JOB)
    wait_until(lambda: cluster.status().world_size == 2, 20, "world 2")
    cluster.kill("b", signal.SIGTERM)
    assert cluster.agents["b"].proc.wait(10) == 0
    # A clean stop revokes the lease: the survivor re-plans without waiting for the TTL.
    t0 = time.monotonic()
    wait_until(lambda: cluster.status("a").world_size == 1, 5, "world 1")
    assert time.monotonic() - t0 < TTL


async def _no_fence(reason: str) -> None:
    raise AssertionError(f"fenced: {reason}")


def test_a_leave_etcd_does_not_answer_says_so_and_still_leaves(etcd, caplog) -> None:
    """Leaving while etcd is down, the lease cannot be revoked: the agent says so (its peers
    see it go only when the lease expires) and leaves all the same."""
    keys = Keys("leave-down")

    async def scenario() -> None:
        e = Etcd(etcd.endpoint, timeout=1)
        try:
            member = Membership(e, keys, NodeRecord("a", "127.0.0.1:1", "", 1), TTL, _no_fence)
            task = asyncio.create_task(member.run())
            await asyncio.wait_for(member.joined.wait(), 5)
            lease = member.lease_id
            etcd.kill()
            with caplog.at_level(logging.WARNING, logger="daemon.control.membership"):
                await member.leave()
            await asyncio.wait_for(task, 5)
            assert member.lease_id == 0 and not member.joined.is_set()
            assert f"leaving without revoking lease {lease:x}" in caplog.text
            assert f"within {TTL}s" in caplog.text
        finally:
            await e.close()

    asyncio.run(scenario())


def test_view_follows_an_etcd_whose_revision_went_backwards(etcd) -> None:
    """etcd restored from an older state (here: wiped and restarted on the same ports): the
    revision and the generation number go backwards, and the view must follow, not ignore it."""
    import shutil

    job = jobmod.loads(TINY_JOB)
    keys = Keys("restored")

    def plan(number: int) -> bytes:
        return plan_generation(job, [NodeInfo("a", 1)], number, ("h", 1)).to_json().encode()

    async def scenario() -> None:
        e = Etcd(etcd.endpoint, timeout=2)
        view = ClusterView(e, keys, retry_s=0.05)
        task = asyncio.create_task(view.run())
        try:
            for number in range(1, 6):
                await e.put(keys.generation, plan(number))
            assert await view.wait_for(lambda: view.generation == 5, 10)
            high = view.revision
            etcd.kill()
            shutil.rmtree(etcd.data_dir)
            etcd.start()
            for _ in range(100):  # the client reconnects to the new etcd
                try:
                    await e.put(keys.generation, plan(2))  # a "restored", shorter history
                    break
                except ETCD_ERRORS:
                    await asyncio.sleep(0.1)
            assert await view.wait_for(lambda: view.generation == 2, 15), view.generation
            assert view.plan is not None and view.plan.generation == 2
            assert view.revision < high
            await e.put(keys.generation, plan(3))  # and it keeps following from there
            assert await view.wait_for(lambda: view.generation == 3, 10)
        finally:
            task.cancel()
            await e.close()

    asyncio.run(scenario())


def test_view_follows_an_etcd_rewound_between_its_read_and_its_watch(etcd) -> None:
    """The same restore, landing in the window after the view read the keys at revision r and
    before its watch from r + 1 reached etcd. etcd accepts a watch from a revision it has not
    reached yet and stays silent until it does, so a view that trusted that watch would miss
    every change of the restored history. A listener runs inside the view's notification of
    its read, before the watch is opened: blocking there (listeners must not, in the product)
    puts the restore in exactly that window."""
    import shutil

    job = jobmod.loads(TINY_JOB)
    keys = Keys("rewound")

    def plan(number: int) -> bytes:
        return plan_generation(job, [NodeInfo("a", 1)], number, ("h", 1)).to_json().encode()

    restored: list[int] = []

    def restore_once(kinds: set[str]) -> None:
        if "connection" in kinds and not restored:
            restored.append(view.revision)
            etcd.kill()
            shutil.rmtree(etcd.data_dir)
            etcd.start()

    async def scenario() -> None:
        nonlocal view
        e = Etcd(etcd.endpoint, timeout=2)
        for number in range(1, 6):
            await e.put(keys.generation, plan(number))
        view = ClusterView(e, keys, retry_s=0.05)
        view.subscribe(restore_once)
        task = asyncio.create_task(view.run())
        try:
            assert await view.wait_for(lambda: bool(restored), 10)
            assert restored[0] >= 5
            for _ in range(100):  # the client reconnects to the new etcd
                try:
                    await e.put(keys.generation, plan(2))
                    break
                except ETCD_ERRORS:
                    await asyncio.sleep(0.1)
            assert await view.wait_for(lambda: view.generation == 2, 10), \
                (view.generation, view.revision)
            assert view.revision < restored[0]
            await e.put(keys.generation, plan(3))
            assert await view.wait_for(lambda: view.generation == 3, 10)
            assert not task.done(), task
        finally:
            task.cancel()
            await e.close()

    view: ClusterView
    asyncio.run(scenario())
