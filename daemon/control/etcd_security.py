"""How the agent reaches etcd securely: TLS (server verification, optional client certificate)
and etcd's user/password authentication.

The scheme of the --etcd endpoints decides whether the channel is TLS, and it is never
guessed down: an `https://` endpoint is dialled with TLS or not at all (with no --etcd-ca,
the server is verified against the system's roots), `http://` with TLS files is a
contradiction and refused, and a list that mixes the two is refused. An endpoint without a
scheme follows etcdctl: TLS when TLS files are given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import grpc

from daemon.secret_files import SecretFileError, read_secret
from daemon.tls_files import TLSFileError, client_credentials

_FLAGS = ("--etcd-ca", "--etcd-cert", "--etcd-key")


class EtcdSecurityError(ValueError):
    pass


@dataclass(frozen=True)
class EtcdSecurity:
    ca: Path | None = None         # verifies etcd's server certificate; None: system roots
    cert: Path | None = None       # client certificate, for etcd's --client-cert-auth
    key: Path | None = None
    user: str = ""                 # etcd user (Auth.Authenticate); "" : etcd auth is off
    password_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise EtcdSecurityError("--etcd-cert and --etcd-key go together")
        if bool(self.user) != (self.password_file is not None):
            raise EtcdSecurityError("--etcd-user and --etcd-password-file go together")

    @property
    def has_tls_files(self) -> bool:
        return any(f is not None for f in (self.ca, self.cert, self.key))

    def uses_tls(self, endpoints: str | Sequence[str]) -> bool:
        """Whether the channel to `endpoints` is TLS; refuses ambiguous combinations."""
        items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        schemes = {urlparse(i.strip()).scheme if "://" in i else "" for i in items if i.strip()}
        if {"http", "https"} <= schemes:
            raise EtcdSecurityError(
                "--etcd mixes http:// and https:// endpoints; every member must use the same "
                "scheme (a plain-text member would receive the credentials in clear)")
        if "https" in schemes:
            return True
        if "http" in schemes and self.has_tls_files:
            raise EtcdSecurityError(
                "--etcd-ca/--etcd-cert/--etcd-key are given but the --etcd endpoints are "
                "http://; write them as https://")
        return self.has_tls_files

    def credentials(self) -> grpc.ChannelCredentials:
        try:
            return client_credentials(self.ca, self.cert, self.key, flags=_FLAGS)
        except TLSFileError as exc:
            raise EtcdSecurityError(str(exc)) from None

    def password(self) -> str:
        if self.password_file is None:
            return ""
        try:
            return read_secret(self.password_file, "--etcd-password-file", os.geteuid())
        except SecretFileError as exc:
            raise EtcdSecurityError(str(exc)) from None
