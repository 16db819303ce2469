"""The address this agent publishes to its peers and workers (docs/multi-host.md).

An agent listening on a wildcard (`--listen 0.0.0.0:7400` or `[::]:7400`) accepts connections
on every interface, but a wildcard is no address to dial: peers read the agent's address from
its `nodes/<node>` record, workers dial the c10d store of the leader at it, and gloo binds the
interface that carries it. So the published host is, in order:

1. `--advertise-host` when given (NAT, several networks, a DNS name: the operator knows best);
2. the listen host when it is a concrete address;
3. the local address the kernel would use to reach the first etcd endpoint that is not on
   loopback here: agents meet in etcd, so the network that reaches etcd is the cluster's;
4. the address of the default route's interface (etcd reached over loopback, e.g. through a
   local etcd gateway);
5. a loopback address from step 3 (a single-machine cluster, nothing else to offer).

No step ever yields a wildcard; when none applies the agent refuses to start and says which
flag to set. Finding a route sends no packet: connecting a UDP socket only consults the
routing table.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from daemon.api.auth import is_loopback

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
_WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")


class AdvertiseError(RuntimeError):
    pass


def is_wildcard(host: str) -> bool:
    return host in _WILDCARDS


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets (what gRPC and URLs expect)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def route_source(host: str, port: int) -> str | None:
    """The local address the kernel would use to reach host:port; None when it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, type_, proto, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, type_, proto) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    return None


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                              struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def default_route_address(route_table: Path = Path("/proc/net/route")) -> str | None:
    """The IPv4 address of the interface the default route leaves through, if there is one."""
    try:
        lines = route_table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # Iface Destination Gateway Flags RefCnt Use Metric Mask ...; default: dest 0, mask 0
        if len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000":
            address = _ipv4_of(fields[0])
            if address is not None:
                return address
    return None


def interface_of(address: str) -> str | None:
    """The name of the interface that carries `address` (IPv4 or IPv6), None if none here."""
    try:
        wanted = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return None
    if wanted.version == 4:
        for _, name in socket.if_nameindex():
            if _ipv4_of(name) == str(wanted):
                return name
        return None
    with contextlib.suppress(OSError):
        # /proc/net/if_inet6: address (32 hex digits), index, prefix, scope, flags, name
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and ipaddress.ip_address(int(fields[0], 16)) == wanted:
                return fields[5]
    return None


def choose(listen_host: str, explicit: str, etcd: Iterable[tuple[str, int]], *,
           route: Callable[[str, int], str | None] = route_source,
           default_route: Callable[[], str | None] = default_route_address) -> str:
    """The host to publish (see the module docstring for the order)."""
    if explicit:
        if is_wildcard(explicit):
            raise AdvertiseError(f"--advertise-host {explicit} is a wildcard, not an address "
                                 "peers can reach")
        return explicit.strip("[]")
    if not is_wildcard(listen_host):
        return listen_host.strip("[]")
    loopback = None
    for host, port in etcd:
        source = route(host, port)
        if source is None or is_wildcard(source):
            continue
        if not is_loopback(source):
            return source
        loopback = loopback or source
    address = default_route()
    if address is not None and not is_wildcard(address) and not is_loopback(address):
        return address
    if loopback is not None:
        return loopback
    raise AdvertiseError(f"--listen {listen_host or '*'} is a wildcard and no route to etcd or "
                         "default route gives an address to publish; set --advertise-host")


def worker_network_env(host: str, env: dict[str, str]) -> dict[str, str]:
    """Environment for this node's workers so gloo binds the interface that carries the
    advertised address. Without it gloo binds whatever the machine's hostname resolves to,
    often 127.0.1.1 on Debian: ranks on other hosts could not connect back. An operator's own
    GLOO_SOCKET_IFNAME wins."""
    if env.get("GLOO_SOCKET_IFNAME"):
        return {}
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return {}
    for address in sorted(addresses):
        name = interface_of(address)
        if name is not None:
            return {"GLOO_SOCKET_IFNAME": name}
    return {}
