"""Each generation's TCPStore listens on the leader's advertised address only, not on every
interface: with `--listen 127.0.0.1`, nothing outside this machine can reach its keys."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import subprocess
from pathlib import Path

import pytest

from daemon.control.store_host import StoreHost
from tests.integration.conftest import TINY_JOB, Cluster, wait_until

pytestmark = pytest.mark.integration

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp*


def listening_hosts(port: int) -> set[str]:
    """The local addresses of the sockets listening on TCP `port` (IPv4 and IPv6)."""
    out = set()
    for table, width in ((Path("/proc/net/tcp"), 8), (Path("/proc/net/tcp6"), 32)):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_host, hex_port = local.split(":")
            if state != _LISTEN or int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(hex_host)
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
            out.add(str(ipaddress.ip_address(raw)))
    return out


def test_generation_store_listens_on_loopback_only(cluster: Cluster) -> None:
    cluster.start("n1", 1)  # --listen 127.0.0.1:0
    cluster.submit(TINY_JOB)
    plan = wait_until(lambda: cluster.plan().get("store"), 60, "a generation with a store")
    assert plan["host"] == "127.0.0.1"
    assert listening_hosts(plan["port"]) == {"127.0.0.1"}
    # Workers still reach it at the address the plan gives them.
    from torch.distributed import TCPStore

    client = TCPStore(plan["host"], plan["port"], is_master=False,
                      timeout=datetime.timedelta(seconds=10))
    client.set("reach", "yes")
    assert client.get("reach") == b"yes"


def test_store_on_another_address_is_not_on_loopback() -> None:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"],
                         capture_output=True, text=True).stdout.split()
    if "inet" not in out:
        pytest.skip("this machine has no non-loopback IPv4 address")
    address = out[out.index("inet") + 1].split("/")[0]

    async def go() -> int:
        host = StoreHost(address)
        port = await host.open(1)
        try:
            assert listening_hosts(port) == {address}
            with socket.create_connection((address, port), timeout=5):
                pass
            with pytest.raises(ConnectionRefusedError), \
                    socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        finally:
            host.close()
        return port

    asyncio.run(go())


def _listening_ports(pid: int) -> set[int]:
    """Ports with a socket of process `pid` listening on IPv4 TCP. Only that process's: the
    tests run in parallel, and another's listeners come and go on this machine meanwhile."""
    mine = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    return {int(fields[1].split(":")[1], 16)
            for fields in map(str.split, Path("/proc/net/tcp").read_text().splitlines()[1:])
            if fields[3] == _LISTEN and fields[9] in mine}


def test_a_spare_store_started_ahead_serves_the_next_generation_and_only_it() -> None:
    async def go() -> None:
        host = StoreHost("127.0.0.1")
        try:
            host.prepare()
            pid = host.process_pid
            assert pid is not None

            def ports() -> set[int]:
                return _listening_ports(pid)

            spare = await asyncio.to_thread(wait_until, ports, 60, "the spare store")
            assert len(spare) == 1
            assert await host.open(1) == next(iter(spare))  # no new listener: the spare's
            second = await host.open(2)  # no spare left: a fresh store, on a fresh port
            assert second not in spare
            host.prepare_later(0.05)
            third = await asyncio.to_thread(
                wait_until, lambda: ports() - spare - {second}, 10, "the spare started later")
            assert await host.open(3) == next(iter(third))
            # Only the last two generations' stores are kept: the first one's is closed.
            await asyncio.to_thread(wait_until, lambda: ports() == third | {second}, 10,
                                    "generation 1's store to close")
        finally:
            host.close()

    asyncio.run(go())
