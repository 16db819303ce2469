"""`kill -USR1` makes a running agent write every thread's Python stack to its log and go on.

An agent that does not answer, or does not exit after SIGTERM, can then be asked where it is
(the integration tests' `Cluster.stop` does so before it SIGKILLs one that did not exit).
"""

from __future__ import annotations

import signal

import pytest

from tests.integration.conftest import Cluster, wait_until

pytestmark = pytest.mark.integration


def test_sigusr1_writes_the_agent_stacks_to_its_log_and_it_goes_on(cluster: Cluster) -> None:
    agent = cluster.start("n1")
    wait_until(lambda: cluster.status().nodes == 1, 30, "n1 registered")
    agent.proc.send_signal(signal.SIGUSR1)
    # The main thread's stack ends in the agent's entry point (its frames are written
    # together; the threads one after another).
    wait_until(lambda: "daemon/cli/ultrad.py" in agent.log, 10, "the agent's stacks in its log")
    assert "most recent call first" in agent.log, agent.log[-2000:]
    assert agent.proc.poll() is None
    assert cluster.status().nodes == 1  # it still answers
    cluster.stop()
    assert agent.proc.returncode == 0, agent.log[-3000:]
