"""Chaos scenarios: one fault (or one fault pattern) per test, on a real LocalCluster.

Every scenario ends with `ChaosRun.finish_and_check()`: the job finished, every step 1..N is
committed with consumed_samples == step x 10, generations never interleave in steps.jsonl, no
generation number was written twice in etcd, and the committed losses equal a torchrun replay
of the same layout history within 1e-6 relative. Stall and steps re-run go to the report.

Opt-in: ULTRA_CHAOS=1 (`make chaos`) or `pytest tests/chaos --chaos`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from checkpoint.manifest import CheckpointInvalid, verify
from tests import netns
from tests.chaos.runner import ChaosError, ChaosRun, wait
from tests.processes import alive

pytestmark = pytest.mark.chaos

TRIGGER = 10  # just past the step-8 checkpoint (every 4): the recovery re-runs steps 9-10+
NORMAL_RECOVERY_S = 10.0  # leave the old group, form the new one, restore, first step


def hang_bound(run: ChaosRun) -> float:
    """How long a hung worker may stall the job: the hang deadline plus a normal recovery."""
    f = run.faults[0]
    return max(10.0, 5 * f.step_seconds) + NORMAL_RECOVERY_S


def _victim(run: ChaosRun) -> str:
    return run.non_leaders()[-1]


# -- processes die ----------------------------------------------------------------------------


def test_kill_non_leader_agent(chaos) -> None:
    run = chaos()
    run.submit()
    run.wait_step(TRIGGER)
    victim = _victim(run)
    with run.fault(f"SIGKILL agent {victim} (non-leader)"):
        run.kill_agent(victim)
    run.finish_and_check()


def test_kill_one_worker(chaos) -> None:
    # The victim's standby starts once the job trains and imports torch while three ranks
    # train on two cores (up to ~13 s measured): enough steps that the job is still running
    # when it is ready.
    run = chaos(steps=150)
    run.submit()
    run.wait_step(TRIGGER)
    victim = _victim(run)
    standby = run.wait_standby(victim)
    if run.step() > run.steps - 10:
        raise ChaosError(f"step {run.step()} of {run.steps} when {victim}'s standby was ready: "
                         "too late for the fault; give the scenario more steps")
    (pid,) = run.worker_pids(victim)
    with run.fault(f"SIGKILL worker of {victim} (agent alive)"):
        os.kill(pid, signal.SIGKILL)

    def standby_took_over(r: ChaosRun) -> list[str]:
        text = (r.cluster.state_dir / victim / "ultrad.log").read_text(errors="replace")
        took = f"standby worker pid={standby} takes local_rank=0" in text
        return [] if took else [f"{victim}'s standby (pid {standby}) did not take local rank 0"]

    run.finish_and_check(extra_checks=standby_took_over)


# -- hangs ------------------------------------------------------------------------------------


def _stop_worker_scenario(run: ChaosRun, local_rank: int) -> None:
    run.submit()
    run.wait_step(TRIGGER)
    victim = _victim(run)
    pids = sorted(run.worker_pids(victim))
    pid = pids[min(local_rank, len(pids) - 1)]
    with run.fault(f"SIGSTOP worker {pid} of {victim}"):
        run.stop_pid(pid)

    def bounded(r: ChaosRun) -> list[str]:
        stall, bound = r.outcome.stalls[0], hang_bound(r)
        if stall is None:
            return ["no step was committed after the hang"]
        return [] if stall <= bound else [f"stall {stall:.1f}s > bound {bound:.1f}s"]

    run.finish_and_check(extra_checks=bounded)


def test_stop_one_worker_dp(chaos) -> None:
    _stop_worker_scenario(chaos(), 0)


def test_stop_one_worker_tp2(chaos) -> None:
    _stop_worker_scenario(chaos(nodes=2, devices=2, tp=2), 1)


# -- the control plane ------------------------------------------------------------------------


def test_stop_non_leader_agent_no_split_brain(chaos) -> None:
    run = chaos()
    run.submit()
    run.wait_step(TRIGGER)
    victim = _victim(run)
    pid = run.cluster.agents[victim].pid
    with run.fault(f"SIGSTOP agent {victim} for {4 * run.ttl}s, then SIGCONT"):
        run.stop_pid(pid)
    time.sleep(4 * run.ttl)
    run.cont_pid(pid)
    # The generation history and the committed sequence are checked by finish_and_check.
    run.finish_and_check()


def test_kill_leader_right_after_generation(chaos) -> None:
    run = chaos()
    run.submit()
    run.wait_step(TRIGGER)
    leader = run.leader()
    victim = next(n for n in run.live_nodes() if n != leader)
    before = run.status(leader).generation
    (pid,) = run.worker_pids(victim)
    with run.fault(f"SIGKILL worker of {victim} (to make a generation)"):
        os.kill(pid, signal.SIGKILL)
    new = wait(lambda: (g := run.status(leader).generation) > before and g, 30,
               "the leader to write a new generation", interval=0.005)
    with run.fault(f"SIGKILL leader {leader} right after generation {new}", generation=new):
        run.kill_agent(leader)
    run.finish_and_check()


def test_second_failure_during_reformation(chaos) -> None:
    run = chaos(nodes=4)
    run.submit()
    run.wait_step(TRIGGER)
    first, second = run.non_leaders()[:2]
    with run.fault(f"SIGKILL node {first}"):
        run.kill_node(first)
    time.sleep(0.3)
    with run.fault(f"SIGKILL node {second} 0.3s later"):
        run.kill_node(second)
    run.finish_and_check()


def test_etcd_stopped_three_ttls(chaos) -> None:
    # Enough steps that training goes on through the outage (steps are ~0.15 s here).
    run = chaos(steps=80)
    run.submit()
    run.wait_step(TRIGGER)
    workers = run.wait_workers()
    gen = max(line["generation"] for line in run.lines())
    pid = run.etcd_pid()
    with run.fault(f"SIGSTOP etcd for {3 * run.ttl}s", expect_new_generation=False) as f:
        run.stop_pid(pid)
    time.sleep(3 * run.ttl)
    run.cont_pid(pid)
    run.wait_step(f.step + 2, after=time.time())

    def unchanged(r: ChaosRun) -> list[str]:
        out = []
        if after != workers:
            out.append(f"workers restarted: {workers} -> {after}")
        gens = {line["generation"] for line in r.lines() if line["time"] >= f.time}
        if gens - {gen}:
            out.append(f"new generation(s) {sorted(gens - {gen})} after an etcd stop of "
                       f"{3 * r.ttl}s (< --etcd-outage)")
        return out

    after = run.all_worker_pids()
    run.finish_and_check(extra_checks=unchanged)


def test_etcd_stopped_across_the_last_step(chaos) -> None:
    """etcd stops (3 TTLs) while the job trains its last steps: the end must still arrive.

    Found by the chaos suite: the rank-0 agent's progress transactions that timed out while
    etcd was stopped are still applied when it resumes, after the retried `finished` write,
    so `progress` goes back to unfinished (and an older step) and the job stays `running`.
    """
    run = chaos()
    run.submit()
    run.wait_step(run.steps - 18)
    pid = run.etcd_pid()
    with run.fault(f"SIGSTOP etcd for {3 * run.ttl}s over the last steps",
                   expect_new_generation=False):
        run.stop_pid(pid)
    time.sleep(3 * run.ttl)
    run.cont_pid(pid)
    run.finish_and_check()


def test_etcd_killed_and_restarted(chaos) -> None:
    run = chaos()
    run.submit()
    run.wait_step(TRIGGER)
    workers = run.wait_workers()
    assert run.cluster.etcd is not None
    with run.fault("SIGKILL etcd, restart on the same data dir", expect_new_generation=False):
        run.cluster.etcd.kill()
        time.sleep(0.5)
        run.cluster.etcd.start()
    run.wait_step(run.faults[0].step + 2, after=time.time())
    restarted = run.all_worker_pids() != workers
    run.finish_and_check(extra={"workers_restarted": restarted})


def test_quick_rejoin_same_node_id(chaos) -> None:
    run = chaos()
    run.submit()
    run.wait_step(TRIGGER)
    victim = _victim(run)
    with run.fault(f"SIGKILL agent {victim}, restart it within 1s"):
        run.kill_agent(victim)
        time.sleep(0.5)
        run.restart_agent(victim)
    run.finish_and_check()


# -- storage ----------------------------------------------------------------------------------


def _manifests(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("step_*/manifest.json"))


def test_corrupt_newest_checkpoint(chaos) -> None:
    every = 4
    # The durable tier's own fallback: without in-memory snapshots the restore must come from
    # disk (with them it comes from memory: tests/chaos/test_snapshot_scenarios.py).
    run = chaos(every=every, snapshot_every=0)
    run.submit()
    ckpts = run.output / "checkpoints"
    # The first checkpoint at or after step 12 whose manifest is written: corrupt it at once
    # and kill a node before the next one (4 steps later) can commit.
    newest = wait(lambda: (m := _manifests(ckpts)) and int(m[-1].name[5:]) >= 12 and m[-1],
                  180, "a committed checkpoint at step >= 12", interval=0.01)
    shard = max((p for p in newest.iterdir() if p.name.endswith(".distcp")),
                key=lambda p: p.stat().st_size)
    victim = _victim(run)
    corrupted_step = int(newest.name[5:])
    with run.fault(f"flip bytes in {newest.name}/{shard.name}, SIGKILL node {victim}") as f:
        data = bytearray(shard.read_bytes())
        for i in range(16):
            data[len(data) // 2 + i] ^= 0xFF
        shard.write_bytes(bytes(data))
        run.kill_node(victim)

    def fell_back(r: ChaosRun) -> list[str]:
        newer = [x for x in r.lines() if x["generation"] > f.generation]
        if not newer:
            return ["no newer generation committed a step"]
        restored = newer[0]["step"] - 1
        out = []
        if restored != corrupted_step - every:
            out.append(f"the next generation restored step {restored}, expected "
                       f"{corrupted_step - every} (the one before the corrupted "
                       f"step {corrupted_step})")
        if not r.grep_logs("is invalid"):
            out.append("no worker logged that the corrupted checkpoint is invalid")
        return out

    run.finish_and_check(extra_checks=fell_back,
                         extra={"corrupted_step": corrupted_step})


def _mount_tmpfs(path: Path, size: str) -> str:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True)
    return "" if result.returncode == 0 else (result.stderr.strip() or "mount failed")


def _fill(path: Path, leave: int) -> Path:
    """Fill the filesystem of `path` until only about `leave` bytes are free."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    filler = path / "filler.bin"
    with filler.open("wb") as fh:
        remaining = max(0, free - leave)
        chunk = b"\0" * (1 << 20)
        while remaining > 0:
            n = min(len(chunk), remaining)
            try:
                fh.write(chunk[:n])
                fh.flush()
            except OSError:
                break
            remaining -= n
    return filler


def test_disk_full_while_checkpointing(chaos, tmp_path: Path) -> None:
    mnt = tmp_path / "ckptfs"
    error = _mount_tmpfs(mnt, "64m")
    if error:
        pytest.skip(f"cannot mount a tmpfs for the checkpoint dir: {error}")
    run: ChaosRun | None = None
    try:
        run = chaos(checkpoint_dir=str(mnt / "checkpoints"), steps=36)
        run.submit()
        run.wait_step(TRIGGER)
        with run.fault("checkpoint filesystem full (tmpfs filled up)") as f:
            filler = _fill(mnt, leave=64 * 1024)
        # Let the next checkpoint hit ENOSPC, and free the space as soon as the daemon reacted
        # (a new generation) or two checkpoint boundaries passed without a reaction.
        def reacted() -> bool:
            if any(x["time"] >= f.time and x["step"] >= f.step + 2 * run.every
                   for x in run.lines()):
                return True
            with contextlib.suppress(ChaosError):
                return run.status().generation > f.generation
            return False

        with contextlib.suppress(ChaosError):
            wait(reacted, 60, "a reaction to the full disk", interval=0.05)
        filler.unlink()
        freed = time.time()
        enospc = run.grep_logs("No space left") + run.grep_logs("ENOSPC")

        def no_bad_checkpoint(r: ChaosRun) -> list[str]:
            out = []
            for d in _manifests(mnt / "checkpoints"):
                try:
                    verify(d)
                except CheckpointInvalid as exc:
                    out.append(f"a committed checkpoint does not verify: {exc}")
            return out

        gens_during = sorted({x["generation"] for x in run.lines()
                              if f.time <= x["time"] < freed})

        def checks(r: ChaosRun) -> list[str]:
            out = no_bad_checkpoint(r)
            cordoned = r.grep_logs("cordoned node")
            if cordoned:
                out.append(f"a full shared checkpoint dir got nodes cordoned: {cordoned[:2]}")
            return out

        run.finish_and_check(extra_checks=checks, extra={
            "enospc_logged": len(enospc), "generations_while_full": gens_during,
            "first_enospc": enospc[0][:200] if enospc else ""})
    finally:
        if run is not None:
            run.stop()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# -- the network ------------------------------------------------------------------------------


def _death_times(pids: list[int], stop: threading.Event, out: dict[int, float]) -> None:
    """Record (time.time()) when each pid stops being alive; poll until `stop`."""
    while not stop.is_set() and len(out) < len(pids):
        for pid in pids:
            if pid not in out and not alive(pid):
                out[pid] = time.time()
        time.sleep(0.02)


def test_network_partition_one_node(chaos) -> None:
    """Every node on its own host (network namespace) on one bridge, etcd on the bridge; one
    non-leader host's link goes down while the others go on. The cut-off agent reaches neither
    etcd nor a peer, so it must kill its workers before the others' new generation commits a
    step (no second writer); when the link comes back it re-joins and the job finishes exact."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Hosts([f"node-{i}" for i in range(3)]) as hosts:
        run = chaos(hosts=hosts)
        try:
            run.submit()
            run.wait_step(TRIGGER)
            victim = _victim(run)
            pids = run.worker_pids(victim)
            died: dict[int, float] = {}
            stop = threading.Event()
            watcher = threading.Thread(target=_death_times, args=(pids, stop, died), daemon=True)
            watcher.start()
            with run.fault(f"network partition of {victim} (link down) for 5 TTLs") as f:
                hosts.cut(victim)
                run.unreachable.add(victim)
            run.wait_step(0, after=f.time, generation_above=f.generation, timeout=120)
            time.sleep(max(0.0, f.time + 5 * run.ttl - time.time()))
            hosts.heal(victim)
            run.unreachable.discard(victim)
            stop.set()
            watcher.join()

            def fenced(r: ChaosRun) -> list[str]:
                newer = [x for x in r.lines() if x["generation"] > f.generation]
                if not newer:
                    return ["no generation after the partition committed a step"]
                first = min(x["time"] for x in newer)
                late = {pid: died.get(pid) for pid in pids
                        if died.get(pid) is None or died[pid] > first}
                if late:
                    return [f"{victim}'s workers {late} outlived the first step of the "
                            f"new generation at {first:.3f} (a second writer)"]
                return []

            run.finish_and_check(extra_checks=fenced, extra={
                "victim_workers_died_after_s": sorted(round(t - f.time, 2)
                                                       for t in died.values())})
        finally:
            run.stop()


# -- re-planning the mesh ---------------------------------------------------------------------


def _layouts(run: ChaosRun) -> list[tuple[int, int, int, int]]:
    """(generation, dp, tp, pp) of each generation that committed a step, in order."""
    seen: dict[int, tuple[int, int, int, int]] = {}
    for line in run.lines():
        seen.setdefault(line["generation"], (line["generation"], line["dp"], line["tp"],
                                             line["pp"]))
    return [seen[g] for g in sorted(seen)]


def test_kill_node_tp2_keeps_tp(chaos) -> None:
    run = chaos(nodes=3, devices=2, tp=2, parallel={"replan": ["tp", "pp"]})
    run.submit()
    run.wait_step(TRIGGER)
    victim = _victim(run)
    with run.fault(f"SIGKILL node {victim} (3x2 devices, tp 2)"):
        run.kill_node(victim)

    def tp_kept(r: ChaosRun) -> list[str]:
        layouts = [(dp, tp, pp) for _, dp, tp, pp in _layouts(r)]
        return [] if layouts[0] == (3, 2, 1) and layouts[-1] == (2, 2, 1) else [
            f"layouts {layouts}: expected dp 3 -> 2 with tp 2 kept"]

    run.finish_and_check(extra_checks=tp_kept)


def test_kill_node_pp_cannot_be_kept_is_re_planned(chaos) -> None:
    run = chaos(nodes=2, devices=1, parallel={"pp": 2, "replan": ["pp"]})
    run.submit()
    run.wait_step(TRIGGER)
    victim = _victim(run)
    with run.fault(f"SIGKILL node {victim} (pp 2 on two 1-device nodes)"):
        run.kill_node(victim)
    run.wait_step(run.faults[0].step + 1, after=time.time())
    explain = run.ctl("plan", "--explain")
    events = run.ctl("events")

    def re_planned(r: ChaosRun) -> list[str]:
        out = []
        layouts = [(dp, tp, pp) for _, dp, tp, pp in _layouts(r)]
        if layouts[0] != (1, 1, 2) or layouts[-1] != (1, 1, 1):
            out.append(f"layouts {layouts}: expected pp 2 -> pp 1")
        for name, res in (("plan --explain", explain), ("events", events)):
            if res.returncode != 0 or "re-planned to tp1 pp1" not in res.stdout:
                out.append(f"ultractl {name} does not say why pp changed:\n{res.stdout}"
                           f"{res.stderr}")
        if "pp 2 must divide" not in explain.stdout and "= 2 must divide" not in explain.stdout:
            out.append(f"ultractl plan --explain does not give the reason:\n{explain.stdout}")
        return out

    run.finish_and_check(extra_checks=re_planned)
