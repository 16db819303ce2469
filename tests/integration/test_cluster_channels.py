"""The test harness's `Cluster` reaches an agent that is slow to answer a new connection.

`Cluster` keeps one gRPC channel per agent (tests/integration/conftest.py). A connection
attempt must be given the time a loaded machine takes to complete it: gRPC gives up on one that
has not received the server's HTTP/2 SETTINGS frame within its minimum connect timeout, and a
call made without `wait_for_ready` then fails UNAVAILABLE at once. A clean clone failed that way
("connection attempt timed out before receiving SETTINGS frame") when that timeout was 100 ms.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

PAUSE_S = 0.5  # longer than the 100 ms that failed, well inside the call's 5 s deadline


def test_a_first_call_to_an_agent_paused_at_connect_time_succeeds(cluster: Cluster) -> None:
    agent = cluster.start("a")
    assert agent.address not in cluster.channels  # the status call below opens its channel
    os.kill(agent.proc.pid, signal.SIGSTOP)
    resume = threading.Timer(PAUSE_S, os.kill, (agent.proc.pid, signal.SIGCONT))
    resume.start()
    try:
        status = cluster.status("a")
    finally:
        resume.join()
        os.kill(agent.proc.pid, signal.SIGCONT)
    assert status.node == "a"
