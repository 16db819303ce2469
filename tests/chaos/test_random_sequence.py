"""Seeded random fault sequences on a 3-node cluster, checked like every chaos scenario.

Faults are drawn from the cheap ones (agent kill, worker kill, worker SIGSTOP, etcd restart,
quick rejoin with the same node id), spaced so the job progresses: after each fault the test
waits for the recovery (a step committed by a newer generation, or any step for an etcd
restart), restarts a killed agent, and waits until the world is back to its full size and has
committed a step past the one the fault hit. The seed is printed and recorded in the report;
`ULTRA_CHAOS_SEED=N` replays a sequence (the faults, not the timing).

`test_random_sequence_short` (3 faults, fixed default seed) runs in the default suite;
`test_random_sequence_long` (30 faults, `ULTRA_CHAOS_FAULTS`, a fresh seed unless given) is a
chaos scenario (`make chaos`).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.chaos.runner import ChaosError, ChaosRun, wait

CHEAP = ("agent-kill", "worker-kill", "worker-stop", "etcd-restart", "quick-rejoin")
STALL_LIMIT_S = 90.0  # a fault not recovered from within this is a stuck job
# Steps the job is given per fault: the recovery and the wait for the full world, and for an
# etcd restart also the 2 TTLs the harness sleeps while training goes on (about 45 steps of a
# ~0.1 s chaos step here; 60 leaves room for a faster step).
STEPS_PER_FAULT = {kind: 12 for kind in CHEAP} | {"etcd-restart": 12 + 60}


def step_budget(kinds: list[str]) -> int:
    """Steps the job needs for these faults in this order, with 30 around them."""
    return 30 + sum(STEPS_PER_FAULT[k] for k in kinds)


def _inject(run: ChaosRun, rng: random.Random, kind: str) -> str | None:
    """Inject one fault; returns the node whose agent must be restarted afterwards."""
    node = rng.choice(sorted(run.live_nodes()))
    if kind in ("worker-kill", "worker-stop"):
        pid = rng.choice(run.wait_workers()[node])
        if kind == "worker-kill":
            with run.fault(f"SIGKILL worker of {node}"):
                os.kill(pid, signal.SIGKILL)
        else:
            with run.fault(f"SIGSTOP worker of {node}"):
                run.stop_pid(pid)
        return None
    if kind == "agent-kill":
        with run.fault(f"SIGKILL agent {node}"):
            run.kill_agent(node)
        return node
    if kind == "quick-rejoin":
        pause = rng.uniform(0.1, 0.9)
        with run.fault(f"SIGKILL agent {node}, restart after {pause:.1f}s"):
            run.kill_agent(node)
            time.sleep(pause)
            run.restart_agent(node)
        return None
    assert kind == "etcd-restart" and run.cluster.etcd is not None
    pause = rng.uniform(0.2, 1.0)
    with run.fault(f"SIGKILL etcd, restart after {pause:.1f}s", expect_new_generation=False):
        run.cluster.etcd.kill()
        time.sleep(pause)
        run.cluster.etcd.start()
    return None


def _settle(run: ChaosRun, rng: random.Random, restart: str | None, full_world: int) -> None:
    f = run.faults[-1]
    if f.expect_new_generation:
        run.wait_step(0, after=f.time, generation_above=f.generation, timeout=STALL_LIMIT_S)
    else:
        # Training goes on through an etcd restart; let the agents re-attach (within 2 TTLs
        # of etcd's return) before the next fault, so faults do not silently overlap.
        time.sleep(2 * run.ttl)
        if run.finished_now():
            return
        run.wait_step(f.step + 1, after=f.time, timeout=STALL_LIMIT_S)
    if restart is not None:
        run.restart_agent(restart)
    # Past any step a failure of this fault can name (the failing rank may have finished
    # f.step + 1 before rank 0 committed it): the leader forgets a run of failures only once a
    # later generation gets past their steps, and three in a row on one node cordon it
    # (daemon/control/crash_loop.py), which a sequence that keeps hitting one node would
    # otherwise trigger by settling one step too early.
    target = f.step + 2 + rng.randint(0, 2)
    wait(lambda: any(x["world_size"] == full_world and x["time"] >= f.time
                     and x["step"] >= target for x in run.lines()) or run.finished_now(),
         2 * STALL_LIMIT_S, f"the full world to commit step {target} after {f.name}", 0.1)


def random_sequence(chaos, seed: int, faults: int, scenario: str) -> None:
    print(f"\nchaos random sequence: seed {seed}, {faults} faults "
          f"(ULTRA_CHAOS_SEED={seed} to replay it)", flush=True)
    rng = random.Random(seed)
    kinds = [rng.choice(CHEAP) for _ in range(faults)]  # drawn first: they size the job
    run: ChaosRun = chaos(scenario=f"{scenario}(seed={seed})", steps=step_budget(kinds))
    run.submit()
    run.wait_step(6)
    full_world = run.cluster.nodes * run.cluster.devices_per_node
    for i, kind in enumerate(kinds):
        if run.step() >= run.steps - 6 or run.finished_now():
            raise ChaosError(f"the job ran out of steps after {i} of {faults} faults")
        restart = _inject(run, rng, kind)
        print(f"  fault {i + 1}: {run.faults[-1].name} at step {run.faults[-1].step}",
              flush=True)
        _settle(run, rng, restart, full_world)

    def bounded(r: ChaosRun) -> list[str]:
        return [f"fault {i + 1} ({f.name}): stall {s:.1f}s > {STALL_LIMIT_S}s"
                for i, (f, s) in enumerate(zip(r.faults, r.outcome.stalls, strict=True))
                if s is not None and s > STALL_LIMIT_S]

    o = run.finish_and_check(extra_checks=bounded, extra={"seed": seed})
    print(f"chaos random sequence seed {seed}: stalls {[round(s or 0, 1) for s in o.stalls]}, "
          f"re-run {o.reruns}, max rel diff {o.max_rel_diff}", flush=True)


@pytest.mark.integration
def test_random_sequence_short(chaos) -> None:
    seed = int(os.environ.get("ULTRA_CHAOS_SEED", "1"))
    random_sequence(chaos, seed, faults=3, scenario="random-short")


@pytest.mark.chaos
def test_random_sequence_long(chaos) -> None:
    seed = int(os.environ.get("ULTRA_CHAOS_SEED", str(random.SystemRandom().randrange(1 << 31))))
    random_sequence(chaos, seed, int(os.environ.get("ULTRA_CHAOS_FAULTS", "30")),
                    scenario="random-long")
