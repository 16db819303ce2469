"""Chaos scenario of a mixture-of-experts job under expert parallelism (docs/moe.md).

4 nodes x 1 device at ep 4 (one expert per rank); kill -9 of one node leaves dp 3, which ep 4
does not divide: the leader re-plans ep (`parallel.replan = ["ep"]`) to the largest ep dividing
both dp 3 and the 4 experts (ep 1), says why, the survivors restore the expert shards from
peer memory (the in-memory snapshots, resharded across the change of ep) and finish. The shared checks of
`ChaosRun.finish_and_check()` then hold as for a dense job: every step committed once, and the
committed losses equal a torchrun replay of the same layout history (ep included).
"""

from __future__ import annotations

import re
import time

import pytest

from tests.chaos.runner import ChaosRun

pytestmark = pytest.mark.chaos

TRIGGER = 10  # just past the step-8 checkpoint (every 4)
# 4 experts of width 32, top-2, a balancing loss and an expert bias (models.moe.bias_balance,
# restored from the snapshots too) that move the routing within a few steps.
MOE = {"family": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "router_aux_loss_coef": 0.05, "router_bias_update_rate": 0.05}


def _eps(run: ChaosRun) -> list[tuple[int, int]]:
    """(dp, ep) of each generation that committed a step, in order."""
    seen: dict[int, tuple[int, int]] = {}
    for line in run.lines():
        seen.setdefault(line["generation"], (line["dp"], line.get("ep", 1)))
    return [seen[g] for g in sorted(seen)]


def test_kill_node_at_ep4_re_plans_ep(chaos) -> None:
    run = chaos(nodes=4, devices=1, model=MOE, parallel={"ep": 4, "replan": ["ep"]})
    run.submit()
    run.wait_step(TRIGGER)
    victim = run.non_leaders()[-1]
    with run.fault(f"SIGKILL node {victim} (4x1 devices, ep 4)"):
        run.kill_node(victim)
    run.wait_step(run.faults[0].step + 1, after=time.time())
    explain = run.ctl("plan", "--explain")
    events = run.ctl("events")

    def ep_re_planned(r: ChaosRun) -> list[str]:
        out = []
        layouts = _eps(r)
        if layouts[0] != (4, 4) or layouts[-1] != (3, 1):
            out.append(f"(dp, ep) per generation {layouts}: expected (4, 4) -> (3, 1)")
        for name, res in (("plan --explain", explain), ("events", events)):
            if res.returncode != 0 or "re-planned to" not in res.stdout:
                out.append(f"ultractl {name} does not say ep was re-planned:\n{res.stdout}"
                           f"{res.stderr}")
        if "parallel.ep must divide dp" not in explain.stdout:
            out.append(f"ultractl plan --explain does not give the reason:\n{explain.stdout}")
        # The survivors restore the step in flight from peer memory across the change of ep:
        # the snapshots hold the expert shards, resharded from ep 4 to ep 1 on restore.
        restored = [x for x in events.stdout.splitlines() if "restored" in x]
        if not any(re.search(r"restored snapshot@\d+", x) for x in restored):
            out.append(f"no restore from memory in the events:\n{events.stdout}")
        return out

    run.finish_and_check(extra_checks=ep_re_planned)
