"""Several "hosts" on one machine: one network namespace per host, joined by a bridge.

The root namespace holds the bridge at <subnet>.1/24, the subnet being the first of the
documentation ranges (198.51.100.0/24, 203.0.113.0/24, 192.0.2.0/24; never routed on the
internet) that this machine does not already use; host i lives in namespace `<tag>-h<i>` with a
veth whose inside end is `eth0`, at <subnet>.(11 + i). Processes that run there
(`Host.prefix()`) see only that address and their own loopback, so anything that works across
these hosts does not depend on 127.0.0.1.
`Hosts.cut(host)` takes the host's link down (both directions drop, no reset is sent: what a
pulled cable or a dead switch port looks like), `Hosts.heal(host)` brings it back.
`Hosts.resolve(host, names)` gives a host its own /etc/hosts (`ip netns exec` mounts
/etc/netns/<netns>/hosts over it), so names such as `etcd-0.etcd.<ns>.svc` resolve there as
cluster DNS would.

Needs root and `ip netns`; `unavailable()` says why not. One set of hosts at a time per
machine (a file lock), since every set uses the same subnet.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

DOCUMENTATION_SUBNETS = ("198.51.100", "203.0.113", "192.0.2")
LOCK = Path("/tmp/ultrascale-netns.lock")
NETNS_ETC = Path("/etc/netns")  # per-namespace files that `ip netns exec` mounts over /etc


class NetnsError(RuntimeError):
    pass


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"usprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(NetnsError):
        _ip("netns", "delete", probe)
    return None


def free_subnet() -> str:
    """The first documentation /24 (as "a.b.c") that no route or address here uses."""
    used = subprocess.run(["ip", "-o", "route", "show", "table", "all"], capture_output=True,
                          text=True).stdout
    used += subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    for prefix in DOCUMENTATION_SUBNETS:
        if f"{prefix}." not in used:
            return prefix
    raise NetnsError(f"every documentation subnet {DOCUMENTATION_SUBNETS} is in use here")


def _remove_leftovers() -> None:
    """Delete what a killed run left behind (called under the lock, so nobody uses them)."""
    ours = re.compile(r"^us[0-9a-f]{4}(br|v\d+|-h\d+)$")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(": ")[1].split("@")[0] if ": " in line else ""
        if ours.match(name):
            with contextlib.suppress(NetnsError):
                _ip("link", "delete", name)
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in spaces.splitlines():
        name = line.split()[0] if line.split() else ""
        if ours.match(name):
            with contextlib.suppress(NetnsError):
                _ip("netns", "delete", name)
    if NETNS_ETC.is_dir():
        for path in NETNS_ETC.iterdir():
            if ours.match(path.name):
                shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class Host:
    name: str  # e.g. "node-0"
    netns: str
    address: str
    outside: str  # the veth end on the bridge, in the root namespace

    def prefix(self) -> list[str]:
        """Run a command on this host; gloo binds the host's interface, not loopback."""
        return ["ip", "netns", "exec", self.netns, "env", "GLOO_SOCKET_IFNAME=eth0"]


@dataclass
class Hosts:
    names: list[str]
    tag: str = field(default_factory=lambda: f"us{uuid.uuid4().hex[:4]}")
    hosts: dict[str, Host] = field(default_factory=dict)
    bridge: str = ""
    subnet: str = ""  # "a.b.c" of the /24 the hosts are on
    _lock: IO[str] | None = None

    def __enter__(self) -> Hosts:
        self._lock = LOCK.open("w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _create(self) -> None:
        _remove_leftovers()
        self.subnet = free_subnet()
        self.bridge = f"{self.tag}br"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            host = Host(name, f"{self.tag}-h{i}", f"{self.subnet}.{11 + i}", f"{self.tag}v{i}")
            _ip("netns", "add", host.netns)
            self.hosts[name] = host
            inside = f"{self.tag}i{i}"
            _ip("link", "add", host.outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.netns)
            _ip("link", "set", host.outside, "master", self.bridge)
            _ip("link", "set", host.outside, "up")
            ns = ("-n", host.netns)
            _ip(*ns, "link", "set", inside, "name", "eth0")
            _ip(*ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip(*ns, "link", "set", "eth0", "up")
            _ip(*ns, "link", "set", "lo", "up")

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts.values():
            with contextlib.suppress(NetnsError):
                _ip("link", "delete", host.outside)
            with contextlib.suppress(NetnsError):
                _ip("netns", "delete", host.netns)
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
        self.hosts.clear()
        if self.bridge:
            with contextlib.suppress(NetnsError):
                _ip("link", "delete", self.bridge)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    @property
    def bridge_address(self) -> str:
        """The root namespace's address on the hosts' network (where etcd can listen)."""
        return f"{self.subnet}.1"

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def resolve(self, name: str, names: dict[str, str]) -> None:
        """In host `name`, each of `names` resolves to its address (and localhost to
        loopback), for processes started with `Host.prefix()` from now on."""
        etc = NETNS_ETC / self.hosts[name].netns
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost",
                 *(f"{address} {host}" for host, address in names.items())]
        (etc / "hosts").write_text("\n".join(lines) + "\n")

    def cut(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].outside, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].outside, "up")

    @contextlib.contextmanager
    def cut_off(self, name: str) -> Iterator[None]:
        self.cut(name)
        try:
            yield
        finally:
            self.heal(name)
