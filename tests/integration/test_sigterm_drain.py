"""SIGTERM to an agent whose workers train: it drains (the same path as `ultractl drain`), the
job goes on without it from the boundary's checkpoint, no step is lost or re-run, and the
agent exits 0. Real etcd, agents and workers (tests/integration/test_training_elastic.py's
cluster and reference run)."""

from __future__ import annotations

import signal

import pytest

from tests.integration.conftest import wait_until
from tests.integration.test_training_elastic import (  # noqa: F401 - fixtures
    STEPS,
    TRIGGER_STEP,
    check_committed,
    check_no_step_rerun,
    elastic,
    generations,
    reference,
)
from tests.processes import Held, descendants

pytestmark = pytest.mark.integration


def test_sigterm_leaves_at_a_step_boundary_and_exits_0(elastic, reference) -> None:  # noqa: F811
    e = elastic(3)
    e.submit()
    e.wait_step(TRIGGER_STEP)
    leader = e.status().leader
    # A node that does not lead: its leaving then tests the drain, not a leader hand-over.
    victim = next(n for n in ("node-2", "node-1", "node-0") if n != leader)
    proc = e.cluster.agents[victim]
    workers = Held(descendants(proc.pid))
    assert workers.pids, "the victim has no worker"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(240) == 0, e.log(victim)[-3000:]
    assert not workers.running()
    workers.close()
    log = e.log(victim)
    # Left once its generation stopped at the boundary, or once the next one excluded it.
    assert "SIGTERM: draining" in log and "drained: " in log, log[-3000:]
    assert "drain timed out" not in log and "stopping now" not in log, log[-3000:]

    def finished() -> bool:
        status = e.status()
        return status.finished and status.step == STEPS

    wait_until(finished, 240, "the job to finish without the victim", interval=0.25)
    gens = generations(e.lines())
    assert list(gens.values())[-1] == 2, gens
    check_no_step_rerun(e)
    check_committed(e, reference)
    events = e.events()
    assert any(ev["kind"] == "generation" and "(drain)" in ev["message"] for ev in events), \
        [ev["message"] for ev in events]
