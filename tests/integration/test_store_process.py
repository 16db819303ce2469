"""The agent's c10d stores live in a child process (daemon/control/store_process.py): the agent
never imports torch, a store nobody waits for any more is closed, a store process that died is
replaced, and the process dies with the agent. Real processes and real TCPStores."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from daemon.control.store_host import StoreHost, StoreProcessError
from tests.integration.conftest import ROOT, wait_until
from tests.integration.test_store_bind import _listening_ports
from tests.processes import children

pytestmark = pytest.mark.integration

# An agent's use of its StoreHost, in a process of its own: open a generation's store, say
# whether torch is imported here, then hold the store until stdin closes.
_AGENT = textwrap.dedent("""
    import asyncio, json, sys
    from daemon.control.store_host import StoreHost

    async def main():
        host = StoreHost("127.0.0.1")
        host.preload()
        port = await host.open(1)
        print(json.dumps({"port": port, "pid": host.process_pid,
                          "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}),
              flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        host.close()

    asyncio.run(main())
""")


def _client(port: int):  # noqa: ANN202 - torch's TCPStore, imported here only
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_an_agent_hosts_stores_without_importing_torch_and_they_die_with_it() -> None:
    agent = subprocess.Popen([sys.executable, "-c", _AGENT], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert agent.stdout is not None
        line = agent.stdout.readline()
        assert line, f"the agent exited {agent.wait()}"
        reply = json.loads(line)
        assert reply["torch"] == [], "the agent imported torch itself"
        assert children(agent.pid) == [reply["pid"]]
        assert Path(f"/proc/{reply['pid']}/comm").read_text().strip() == "ultra-store"
        client = _client(reply["port"])
        client.set("reach", "yes")
        assert client.get("reach") == b"yes"
        agent.kill()  # no clean-up runs: the store process must go with it all the same
        agent.wait()
        wait_until(lambda: not os.path.exists(f"/proc/{reply['pid']}"), 10,
                   "the store process to die with its agent")
    finally:
        agent.kill()
        agent.wait()


def test_a_store_nobody_waits_for_is_closed_and_a_dead_process_is_replaced() -> None:
    async def go() -> None:
        host = StoreHost("127.0.0.1")
        try:
            # Cancelled before the store process could answer (it is still importing torch).
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(host.open(1), 0.001)
            pid = host.process_pid
            assert pid is not None
            port = await host.open(2)
            # The first generation's store, started after all, is closed once it is made.
            await asyncio.to_thread(wait_until, lambda: _listening_ports(pid) == {port}, 10,
                                    "only generation 2's store")
            client = _client(port)
            client.set("k", "v")
            os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(wait_until, lambda: not host._process.alive, 10,
                                    "the store process's end to be seen")
            third = await host.open(3)
            assert host.process_pid not in (None, pid)
            assert _client(third).add("n", 1) == 1
        finally:
            host.close()

    asyncio.run(go())


def test_a_store_that_cannot_start_raises_naming_its_host() -> None:
    async def go() -> None:
        host = StoreHost("no-such-host.invalid")
        try:
            with pytest.raises(StoreProcessError, match="store host 'no-such-host.invalid'"):
                await host.open(1)
        finally:
            host.close()

    asyncio.run(go())


def test_what_else_writes_to_the_store_processs_stdout_is_never_read_as_a_reply() -> None:
    # The store process with a store start that prints first, as a chatty library would.
    noisy = ("import daemon.control.store_process as m; start = m.start_store; "
             "m.start_store = lambda host: (print('noise', flush=True), start(host))[1]; "
             "m.main()")
    proc = subprocess.Popen([sys.executable, "-c", noisy], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(json.dumps({"seq": 7, "start": "127.0.0.1"}) + "\n", 120)
    finally:
        proc.kill()
        proc.wait()
    reply = json.loads(out.splitlines()[0])
    assert reply["seq"] == 7 and reply["port"] > 0, out
    assert "noise" in err
