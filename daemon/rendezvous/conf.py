"""`--rdzv-endpoint`, `--rdzv-id` and `--rdzv-conf` of `torchrun --rdzv-backend ultrascale`,
checked up front so that a bad value is one line naming what to fix, not a traceback later.

Our keys: `cacert`, `cert`, `key` (PEM files: the CA that verifies etcd, and a client
certificate and its key for etcd's --client-cert-auth), `user` and `password_file` (etcd's
user/password auth; the password is read from a file only its owner can read, since a command
line is visible to every user of the host), `etcd_timeout` (seconds per etcd call). torch's own
keys of its dynamic rendezvous are passed through once they are known to be whole seconds or
counts. Any other key is refused, so a misspelt option is not silently ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from daemon.control.etcd_client import parse_endpoints
from daemon.control.etcd_security import EtcdSecurity
from daemon.control.keys import check_name
from daemon.secret_files import SecretFileError, read_secret
from daemon.tls_files import TLSFileError, read_pem

TLS_KEYS = ("cacert", "cert", "key")
OUR_KEYS = (*TLS_KEYS, "user", "password_file", "etcd_timeout")
# torch's DynamicRendezvousHandler options (seconds, or counts for the keep-alive ones), and
# `timeout`, which torchrun itself always sets (--rdzv-timeout; the dynamic handler ignores it).
TORCH_KEYS = ("timeout", "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
              "keep_alive_interval", "keep_alive_max_attempt")


class RendezvousConfError(ValueError):
    """A bad rendezvous option: the message names it and is one line."""


@dataclass(frozen=True)
class RendezvousConf:
    endpoints: str            # as given: HOST:PORT[,HOST:PORT...], http:// or https:// allowed
    run_id: str
    security: EtcdSecurity
    etcd_timeout: float = 5.0
    torch_options: tuple[tuple[str, int], ...] = ()

    @property
    def tls(self) -> bool:
        return self.security.uses_tls(self.endpoints)


def _opt(key: str, value: Any) -> str:
    return f"--rdzv-conf {key}={value}"


def _positive_int(key: str, value: Any) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if number <= 0:
        raise RendezvousConfError(f"{_opt(key, value)}: expected a whole number > 0")
    return number


def _seconds(key: str, value: Any) -> float:
    try:
        number = float(str(value).strip())
    except ValueError:
        number = float("nan")
    if not number > 0:
        raise RendezvousConfError(f"{_opt(key, value)}: expected seconds > 0")
    return number


def _endpoints(spec: str, tls_files: bool) -> str:
    if not spec.strip():
        raise RendezvousConfError("--rdzv-endpoint: give the etcd members, HOST:PORT[,HOST:PORT...]")
    try:
        parse_endpoints(spec)
    except ValueError:
        raise RendezvousConfError(f"--rdzv-endpoint {spec}: expected HOST:PORT[,HOST:PORT...], "
                                  "each optionally http:// or https://") from None
    schemes = {urlparse(i.strip()).scheme if "://" in i else "" for i in spec.split(",")
               if i.strip()}
    if {"http", "https"} <= schemes:
        raise RendezvousConfError(f"--rdzv-endpoint {spec}: mixes http:// and https://; every "
                                  "member must use the same scheme")
    if "http" in schemes and tls_files:
        raise RendezvousConfError(f"--rdzv-endpoint {spec}: http:// with --rdzv-conf "
                                  "cacert/cert/key; write the endpoints as https:// or HOST:PORT")
    return spec


def _pem(key: str, value: str | None) -> Path | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        read_pem(path, f"--rdzv-conf {key}=")
    except TLSFileError as exc:
        raise RendezvousConfError(str(exc).replace("= ", "=", 1)) from None
    return path


def parse(endpoint: str, run_id: str, config: Mapping[str, Any]) -> RendezvousConf:
    """The options of one torchrun; RendezvousConfError names the first bad one."""
    unknown = sorted(set(config) - set(OUR_KEYS) - set(TORCH_KEYS))
    if unknown:
        raise RendezvousConfError(
            f"--rdzv-conf {unknown[0]}: unknown option for --rdzv-backend ultrascale (known: "
            f"{', '.join(OUR_KEYS + TORCH_KEYS)})")
    try:
        check_name("--rdzv-id", run_id)
    except ValueError as exc:
        raise RendezvousConfError(f"{exc}; it names the job's keys in etcd") from None
    files = {k: config.get(k) for k in TLS_KEYS}
    if (files["cert"] is None) != (files["key"] is None):
        raise RendezvousConfError("--rdzv-conf cert= and key= go together (the client "
                                  "certificate and its private key)")
    user, password_file = config.get("user"), config.get("password_file")
    if (user is None) != (password_file is None):
        missing = "password_file" if password_file is None else "user"
        raise RendezvousConfError(f"--rdzv-conf {missing}: user= and password_file= go together")
    if user is not None:
        try:
            check_name("--rdzv-conf user", str(user))
        except ValueError as exc:
            raise RendezvousConfError(str(exc)) from None
        try:
            read_secret(Path(password_file).expanduser(), "--rdzv-conf password_file=",
                        os.geteuid())
        except SecretFileError as exc:
            raise RendezvousConfError(str(exc).replace("= ", "=", 1)) from None
    paths = {k: _pem(k, v) for k, v in files.items()}
    endpoints = _endpoints(endpoint, any(p is not None for p in paths.values()))
    security = EtcdSecurity(ca=paths["cacert"], cert=paths["cert"], key=paths["key"],
                            user=str(user or ""),
                            password_file=Path(password_file).expanduser() if password_file
                            else None)
    etcd_timeout = (_seconds("etcd_timeout", config["etcd_timeout"])
                    if "etcd_timeout" in config else 5.0)
    torch_options = tuple((k, _positive_int(k, config[k])) for k in TORCH_KEYS if k in config)
    return RendezvousConf(endpoints, run_id, security, etcd_timeout, torch_options)
