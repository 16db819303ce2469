"""A TLS-only etcd (client certificates required) with etcd's auth enabled, for security tests.

Auth is enabled the way an operator would (etcdctl's `user add`, `role add`, `auth enable`), as
raw etcd v3 Auth RPCs over the same TLS channel: `root` with the root role, and a least-
privilege user `ultrad` whose role may read and write `/ultrascale/` only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc
from aetcd import rpc
from aetcd.rpc import auth_pb2

from daemon.control.etcd_security import EtcdSecurity
from daemon.control.etcd_server import EtcdServer, EtcdServerTLS
from tests.pki import CA, Pair

USER = "ultrad"
PREFIX = b"/ultrascale/"


@dataclass(frozen=True)
class SecureEtcd:
    server: EtcdServer
    ca: CA
    client: Pair          # a client certificate etcd accepts
    password_file: Path   # USER's password, 0600

    def security(self, *, user: bool = True) -> EtcdSecurity:
        return EtcdSecurity(ca=self.ca.cert, cert=self.client.cert, key=self.client.key,
                            user=USER if user else "",
                            password_file=self.password_file if user else None)

    def flags(self) -> list[str]:
        return ["--etcd-ca", str(self.ca.cert), "--etcd-cert", str(self.client.cert),
                "--etcd-key", str(self.client.key), "--etcd-user", USER,
                "--etcd-password-file", str(self.password_file)]


def start_secure_etcd(root: Path, ca: CA) -> SecureEtcd:
    server_pair = ca.issue("etcd-server")
    client = ca.issue("etcd-client")
    server = EtcdServer(root / "etcd", tls=EtcdServerTLS(server_pair.cert, server_pair.key,
                                                          ca.cert)).start()
    password_file = root / "etcd-password"
    password_file.write_text("s3cret-ultrad\n")
    password_file.chmod(0o600)
    try:
        asyncio.run(_enable_auth(server, ca, client, "s3cret-ultrad"))
    except BaseException:
        server.stop()
        raise
    return SecureEtcd(server, ca, client, password_file)


async def _enable_auth(server: EtcdServer, ca: CA, client: Pair, password: str) -> None:
    creds = grpc.ssl_channel_credentials(ca.cert.read_bytes(), client.key.read_bytes(),
                                         client.cert.read_bytes())
    async with grpc.aio.secure_channel(f"{server.host}:{server.client_port}", creds) as channel:
        auth = rpc.AuthStub(channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="root-pw"), timeout=10)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=10)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"),
                                 timeout=10)
        await auth.UserAdd(rpc.AuthUserAddRequest(name=USER, password=password), timeout=10)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="ultrascale"), timeout=10)
        end = PREFIX[:-1] + bytes([PREFIX[-1] + 1])
        await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
            name="ultrascale", perm=auth_pb2.Permission(
                permType=auth_pb2.Permission.READWRITE, key=PREFIX, range_end=end)), timeout=10)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=USER, role="ultrascale"),
                                 timeout=10)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)



def void_auth_tokens(etcd: SecureEtcd) -> None:
    """Make etcd forget every auth token it issued (auth disable, then enable, as root), so a
    client's next call is refused with "invalid auth token", as after an etcd restart that
    lost them. (A restart alone does not lose them reliably: etcd replays the Authenticate
    requests in its write-ahead log and restores the tokens they issued.)"""

    async def go() -> None:
        server, ca, client = etcd.server, etcd.ca, etcd.client
        creds = grpc.ssl_channel_credentials(ca.cert.read_bytes(), client.key.read_bytes(),
                                             client.cert.read_bytes())
        async with grpc.aio.secure_channel(f"{server.host}:{server.client_port}",
                                           creds) as channel:
            auth = rpc.AuthStub(channel)
            token = (await auth.Authenticate(
                rpc.AuthenticateRequest(name="root", password="root-pw"), timeout=10)).token
            await auth.AuthDisable(rpc.AuthDisableRequest(), timeout=10,
                                   metadata=(("token", token),))
            await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)

    asyncio.run(go())
