"""The address an agent publishes: never a wildcard; an explicit --advertise-host wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.api.advertise import (
    AdvertiseError,
    choose,
    default_route_address,
    host_port,
    interface_of,
    route_source,
    worker_network_env,
)
from daemon.cli.ultrad import UsageError, _parser, build_config, resolve_options

pytestmark = pytest.mark.unit

ETCD = [("etcd-a.example", 2379), ("etcd-b.example", 2379)]


def routes(table: dict[str, str | None]):
    return lambda host, port: table.get(host)


def test_explicit_advertise_host_wins() -> None:
    def never(*_: object) -> str:
        raise AssertionError("no lookup when the operator named the host")

    assert choose("0.0.0.0", "node-7.example", ETCD, route=never, default_route=never) \
        == "node-7.example"
    assert choose("10.0.0.5", "203.0.113.9", ETCD, route=never, default_route=never) \
        == "203.0.113.9"
    assert choose("[::]", "[2001:db8::7]", ETCD, route=never, default_route=never) \
        == "2001:db8::7"


def test_a_concrete_listen_host_is_published_as_is() -> None:
    assert choose("10.0.0.5", "", ETCD, route=routes({}), default_route=lambda: None) \
        == "10.0.0.5"
    assert choose("[::1]", "", ETCD, route=routes({}), default_route=lambda: None) == "::1"


def test_wildcard_publishes_the_address_that_routes_to_etcd() -> None:
    table = {"etcd-a.example": None, "etcd-b.example": "198.51.100.12"}
    for wildcard in ("0.0.0.0", "[::]", "::", ""):
        assert choose(wildcard, "", ETCD, route=routes(table),
                      default_route=lambda: "192.0.2.99") == "198.51.100.12"


def test_etcd_over_loopback_falls_back_to_the_default_route_then_to_loopback() -> None:
    local = routes({"etcd-a.example": "127.0.0.1", "etcd-b.example": "127.0.0.1"})
    assert choose("0.0.0.0", "", ETCD, route=local, default_route=lambda: "192.0.2.99") \
        == "192.0.2.99"
    # A single machine with no default route: loopback is all there is, and it works there.
    assert choose("0.0.0.0", "", ETCD, route=local, default_route=lambda: None) == "127.0.0.1"


def test_no_address_at_all_is_an_error_naming_the_flag() -> None:
    with pytest.raises(AdvertiseError, match="--advertise-host"):
        choose("0.0.0.0", "", ETCD, route=routes({}), default_route=lambda: None)
    with pytest.raises(AdvertiseError, match="--advertise-host 0.0.0.0"):
        choose("0.0.0.0", "0.0.0.0", ETCD)


def test_ultrad_refuses_a_wildcard_advertise_host() -> None:
    for wildcard in ("0.0.0.0", "::"):
        args = _parser().parse_args(["--etcd", "127.0.0.1:2379", "--devices", "1",
                                     "--listen", "0.0.0.0:7400", "--insecure",
                                     "--advertise-host", wildcard])
        with pytest.raises(UsageError, match="--advertise-host"):
            build_config(resolve_options(args, {}))


def test_host_port_brackets_ipv6() -> None:
    assert host_port("192.0.2.5", 7400) == "192.0.2.5:7400"
    assert host_port("2001:db8::5", 7400) == "[2001:db8::5]:7400"
    assert host_port("node-1.example", 7400) == "node-1.example:7400"


def test_kernel_lookups_on_loopback() -> None:
    # The real routing table and interfaces of this machine: loopback always exists.
    assert route_source("127.0.0.1", 2379) == "127.0.0.1"
    assert route_source("no-such-host.invalid", 2379) is None
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("not an address") is None


def test_default_route_reads_the_route_table(tmp_path: Path) -> None:
    table = tmp_path / "route"
    header = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"
    table.write_text(header + "lo\t0000007F\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0\n")
    assert default_route_address(table) is None  # no default route in it
    table.write_text(header + "lo\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    assert default_route_address(table) == "127.0.0.1"  # the address of its interface
    assert default_route_address(tmp_path / "missing") is None


def test_workers_bind_gloo_to_the_advertised_interface() -> None:
    assert worker_network_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert worker_network_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"}) == {}
    # Not on any interface here (240/4 is reserved, never assigned) or not resolvable: gloo
    # is left to its own choice rather than bound to a wrong interface.
    assert worker_network_env("240.0.0.1", {}) == {}
    assert worker_network_env("no-such-host.invalid", {}) == {}
