"""SIGHUP (a closed terminal, or `systemctl kill -s HUP`) neither stops nor changes an agent:
ultrad reads its configuration only at start, and says so in its log."""

from __future__ import annotations

import signal

import pytest

from tests.integration.conftest import Cluster, wait_until

pytestmark = pytest.mark.integration


def test_sighup_is_logged_and_ignored(cluster: Cluster) -> None:
    agent = cluster.start("n1", 1)
    wait_until(lambda: cluster.status().nodes == 1, 30, "n1 registered")
    agent.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "SIGHUP" in agent.log or agent.proc.poll() is not None, 10,
               "the agent to log the SIGHUP")
    assert agent.proc.poll() is None, f"SIGHUP stopped the agent:\n{agent.log[-2000:]}"
    assert "SIGHUP" in agent.log
    # Still serving, still a member.
    assert cluster.status().nodes == 1
