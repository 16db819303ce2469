"""ultrad: the per-node agent.

    ultrad --etcd URL[,URL] --node-id ID --devices N --listen ADDR --metrics-listen ADDR \\
           --state-dir DIR [--token-file F] [--insecure] [--config FILE] \\
           [--tls-cert F --tls-key F [--tls-ca F]] \\
           [--etcd-ca F] [--etcd-cert F --etcd-key F] [--etcd-user U --etcd-password-file F]
    ultrad local JOB.toml --nodes N --devices-per-node K [--state-dir DIR] [--set k=v ...]

Every flag falls back to an `ULTRA_<FLAG>` environment variable (e.g. ULTRA_NODE_ID), then to
the TOML file given by --config (keys as the flags, with underscores; as strict as a job file:
types, ranges, unknown keys), then to its default.
Exit codes: 0 clean stop, 1 failure, 2 usage (a bad flag, variable, --config key or file: one
line naming it). SIGTERM drains a running job first (leave at a step boundary after a
checkpoint); SIGINT, or a second SIGTERM, stops at once; SIGHUP is logged and ignored
(docs/systemd.md). `ultrad --version` prints the version.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from checkpoint.snapshot_format import default_base
from daemon.api.advertise import is_wildcard
from daemon.api.auth import AuthError, check_listen, is_loopback, split_host_port
from daemon.api.probes import check_health_listen
from daemon.cli.usage import MAX_DEVICES, UsageError, check_directory
from daemon.control.etcd_client import parse_endpoints
from daemon.control.job_submit import read_job_file
from daemon.control.keys import check_name
from daemon.procutil import arm_parent_death
from daemon.secret_files import read_secret
from daemon.tls_files import read_pem
from parallel import bounded_toml
from parallel import job as jobmod
from parallel.cli_common import Parser, add_version

log = logging.getLogger("ultrad")


PathList = tuple[str, ...]  # `allowed_paths`: a TOML list, or (flag, env) paths joined by ':'
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_DEVICE_MEMORY = 2**50  # bytes per device (a PiB)

# name: (type, default, help); None default = required. The type is what a --config value must
# be (checked as a job file's values are); a flag or ULTRA_* variable is text read as that type.
_OPTIONS: dict[str, tuple[Any, Any, str]] = {
    "etcd": (str, None, "etcd endpoints, comma separated (host:port, http:// or https://)"),
    "etcd_ca": (str, "", "CA (PEM) that verifies etcd's certificate (https:// without it: "
                         "the system's roots)"),
    "etcd_cert": (str, "", "client certificate (PEM) for etcd's --client-cert-auth"),
    "etcd_key": (str, "", "its private key (PEM)"),
    "etcd_user": (str, "", "etcd user, when etcd auth is enabled"),
    "etcd_password_file": (str, "", "file holding that user's password (mode 0600)"),
    "node_id": (str, socket.gethostname().split(".")[0], "this node's id (default: hostname)"),
    "devices": (int, None, f"devices (workers) on this node, in [0, {MAX_DEVICES}] (required)"),
    "device_memory": (int, 0, "bytes of memory per device, for the planner's memory check of "
                              "jobs that allow re-planning (0: unknown, not checked)"),
    "listen": (str, "127.0.0.1:7400", "gRPC listen address for ultractl and peers"),
    "metrics_listen": (str, "127.0.0.1:9400", "Prometheus /metrics listen address"),
    "health_listen": (str, "", "plaintext grpc.health.v1 listen address for Kubernetes probes "
                               "(services readiness, liveness; empty: off)"),
    "state_dir": (str, "/var/lib/ultrad", "state directory (token, socket, worker logs)"),
    "token_file": (str, "", "admin bearer token file (default: generated in the state dir)"),
    "job": (str, "default", "job namespace in etcd: keys live under /ultrascale/<job>/"),
    "job_file": (str, "", "job file (TOML) to submit at start unless a job is already stored"),
    "allowed_paths": (PathList, (), "directories, separated by ':', that a job's paths (its "
                                     "output, checkpoint, data and cache directories) must lie "
                                     "under (default: the state dir)"),
    "ttl": (int, 5, "lease TTL in seconds; every other timeout derives from it"),
    "advertise_host": (str, "", "host peers and workers reach this agent at (default: the "
                                "listen host; for a wildcard listen, the address that routes "
                                "to etcd)"),
    "tls_cert": (str, "", "TLS certificate (PEM) for the gRPC listener"),
    "tls_key": (str, "", "TLS private key (PEM)"),
    "tls_ca": (str, "", "CA (PEM) that client certificates must chain to (mTLS)"),
    "worker_module": (str, "trainer.worker", "python module a worker runs"),
    "etcd_outage": (float, 60.0, "seconds workers keep training while etcd is unreachable for "
                                 "every agent"),
    "snapshot_dir": (str, str(default_base()),
                     "memory-backed directory for in-memory snapshots (<dir>/<job>/<node>; a "
                     "tmpfs with room for this node's shards and its buddy's): this user's own, "
                     "made mode 0700 if missing; one owned by another user, writable by group "
                     "or others, or a symbolic link is refused"),
    "log_level": (str, "info", "|".join(LOG_LEVELS)),
}
_FLAGS = {"insecure": "allow a non-loopback listen address without TLS",
          "no_workers": "control plane only: plan generations but start no worker processes",
          "no_standby_worker": "keep no spare worker process (torch imported) to replace a "
                               "dead worker at once"}


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="ultrad", description=__doc__)
    add_version(p, "ultrad")
    p.add_argument("--config", help="TOML file with defaults for the flags below (env "
                                    "ULTRA_CONFIG)")
    for name, (_, default, help_) in _OPTIONS.items():
        # The flags default to None (unset: the variable, the file, then this default).
        shown = ":".join(default) if isinstance(default, tuple) else default
        if shown not in (None, "") and "default" not in help_:
            help_ = f"{help_} (default: {shown})"
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                       help=help_.replace("%", "%%"))
    for name, help_ in _FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, action="store_true",
                       default=None, help=help_)
    return p


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _from_text(type_: Any, text: str) -> Any:
    """A flag's or variable's text as `type_`; ValueError when it is not one."""
    if type_ is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError
        return text.lower() in _TRUE
    if type_ is int:
        if not _INTEGER.fullmatch(text.strip()):
            raise ValueError
        return int(text)
    if type_ is PathList:
        return tuple(p for p in text.split(os.pathsep) if p)
    return type_(text)


def _type_name(type_: Any) -> str:
    return {PathList: f"paths separated by '{os.pathsep}'", bool: "true or false"}.get(
        type_, getattr(type_, "__name__", str(type_)))


def _read_config(config: str) -> dict[str, Any]:
    try:
        values = bounded_toml.loads(Path(config).read_text(), f"--config {config}")
    except OSError as exc:
        raise UsageError(f"--config {config}: {exc.strerror or exc}") from None
    except bounded_toml.TomlError as exc:
        raise UsageError(str(exc)) from None
    known = set(_OPTIONS) | set(_FLAGS)
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"--config {config}: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    return values


def resolve_options(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """flag > ULTRA_* env > --config file > default, with types checked and fields named."""
    config = args.config or env.get("ULTRA_CONFIG")
    file_values = _read_config(config) if config else {}
    out: dict[str, Any] = {}
    for name, (type_, default, _) in {**_OPTIONS, **{f: (bool, False, "") for f in _FLAGS}}.items():
        flag, var = f"--{name.replace('_', '-')}", f"ULTRA_{name.upper()}"
        if name in file_values:  # the file's values are TOML, typed: checked as a job's are
            try:
                value = jobmod.coerce(f"--config {config}: {name}", type_, file_values[name])
            except jobmod.ConfigError as exc:
                raise UsageError(str(exc)) from None
        else:
            value = default
        for where, text in ((flag, getattr(args, name)), (var, env.get(var))):
            if text is None:
                continue
            try:
                value = text if isinstance(text, bool) else _from_text(type_, text)
            except ValueError:
                raise UsageError(f"{where} must be {_type_name(type_)} (got {text!r})") from None
            break
        if value is None:
            raise UsageError(f"{flag} is required (or {var}, or `{name}` in --config)")
        out[name] = value
    return out


def build_config(opts: dict[str, Any]) -> Any:
    from daemon.config import AgentConfig, TLSConfig

    try:
        parse_endpoints(opts["etcd"])
        check_name("--node-id", opts["node_id"])
        check_name("--job", opts["job"])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not 0 <= opts["devices"] <= MAX_DEVICES:
        raise UsageError(f"--devices must be in [0, {MAX_DEVICES}] (got {opts['devices']})")
    if not 0 <= opts["device_memory"] <= MAX_DEVICE_MEMORY:
        raise UsageError(f"--device-memory must be in [0, 2**50] bytes "
                         f"(got {opts['device_memory']})")
    if opts["log_level"].lower() not in LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)} "
                         f"(got {opts['log_level']!r})")
    if not 0 <= opts["etcd_outage"] <= 86400:  # also refuses nan and inf
        raise UsageError(f"--etcd-outage must be in [0, 86400] seconds "
                         f"(got {opts['etcd_outage']})")
    if not 2 <= opts["ttl"] <= 3600:
        raise UsageError(f"--ttl must be in [2, 3600] seconds (etcd's minimum lease is 2; "
                         f"got {opts['ttl']})")
    if opts["advertise_host"] and is_wildcard(opts["advertise_host"]):
        raise UsageError(f"--advertise-host {opts['advertise_host']} is a wildcard; give an "
                         "address or name peers can reach")
    if bool(opts["tls_cert"]) != bool(opts["tls_key"]):
        raise UsageError("--tls-cert and --tls-key go together")
    if opts["tls_ca"] and not opts["tls_cert"]:
        # Without a certificate the listener is plain text: the CA would require nothing.
        raise UsageError("--tls-ca needs --tls-cert and --tls-key (it makes the TLS listener "
                         "require client certificates; alone it would leave it plain text)")
    state_dir = Path(opts["state_dir"]).expanduser()
    check_directory("--state-dir", state_dir)
    check_directory("--snapshot-dir", Path(opts["snapshot_dir"]).expanduser())
    allowed_paths = tuple(Path(p).expanduser().absolute() for p in opts["allowed_paths"])
    job_roots = allowed_paths or (state_dir,)
    tls = None
    if opts["tls_cert"]:
        tls = TLSConfig(Path(opts["tls_cert"]), Path(opts["tls_key"]),
                        Path(opts["tls_ca"]) if opts["tls_ca"] else None)
    try:
        for flag in ("tls_cert", "tls_key", "tls_ca"):
            if opts[flag]:
                read_pem(Path(opts[flag]), f"--{flag.replace('_', '-')}")
        etcd_security = _etcd_security(opts)
        token_file = Path(opts["token_file"]).expanduser() if opts["token_file"] else None
        if token_file is not None and token_file.exists():
            # Owner and mode now, as a usage error; a missing file is reported at start.
            read_secret(token_file, "--token-file", os.geteuid())
        check_listen(opts["listen"], tls=tls is not None, insecure=opts["insecure"])
        # /metrics serves no secret and takes no input, so Prometheus on another host may
        # scrape it without --insecure (which would also allow a clear-text gRPC listener).
        split_host_port(opts["metrics_listen"], "--metrics-listen")
        if opts["job_file"]:
            read_job_file(Path(opts["job_file"]), job_roots)
        if opts["health_listen"]:
            check_health_listen(opts["health_listen"])
    except (AuthError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return AgentConfig(
        etcd_security=etcd_security,
        node_id=opts["node_id"], devices=opts["devices"], etcd=opts["etcd"],
        device_memory=opts["device_memory"],
        listen=opts["listen"], metrics_listen=opts["metrics_listen"],
        health_listen=opts["health_listen"],
        state_dir=state_dir, job=opts["job"], ttl=opts["ttl"], allowed_paths=allowed_paths,
        job_file=Path(opts["job_file"]) if opts["job_file"] else None,
        token_file=Path(opts["token_file"]).expanduser() if opts["token_file"] else None,
        insecure=opts["insecure"], tls=tls, advertise_host=opts["advertise_host"],
        workers=not opts["no_workers"], worker_module=opts["worker_module"],
        standby_worker=not opts["no_standby_worker"],
        etcd_outage_s=opts["etcd_outage"],
        snapshot_base=Path(opts["snapshot_dir"]).expanduser(),
    )


def _etcd_security(opts: dict[str, Any]) -> Any:
    """Checked now, so a typo fails at start with the flag's name, not at the first call."""
    from daemon.control.etcd_security import EtcdSecurity

    def path(name: str) -> Path | None:
        return Path(opts[name]).expanduser() if opts[name] else None

    security = EtcdSecurity(ca=path("etcd_ca"), cert=path("etcd_cert"), key=path("etcd_key"),
                            user=opts["etcd_user"], password_file=path("etcd_password_file"))
    tls = security.uses_tls(opts["etcd"])
    if tls:
        security.credentials()
    security.password()
    remote = [h for h, _ in parse_endpoints(opts["etcd"]) if not is_loopback(h)]
    if security.user and not tls and remote and not opts["insecure"]:
        raise UsageError(f"--etcd-user: the password would cross the network in clear text to "
                         f"{remote[0]}; use https:// endpoints or pass --insecure")
    return security


async def run_agent(config: Any) -> int:
    from daemon.service import Service

    return await Service(config).run()


def main(argv: list[str] | None = None) -> int:
    arm_parent_death()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["local"]:
        from daemon.cli.local import main as local_main

        return local_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        opts = resolve_options(args, dict(os.environ))
        config = build_config(opts)
    except UsageError as exc:
        print(f"ultrad: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=opts["log_level"].upper(), stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s ultrad[{config.node_id}] %(name)s: %(message)s")
    # grpc's own debug logs (a traceback per cancelled stream) drown the agent's.
    logging.getLogger("grpc").setLevel(max(logging.INFO, logging.getLogger().level))
    # `kill -USR1` writes every thread's Python stack to stderr (the agent's log): an agent that
    # does not answer or does not exit shows where it is. From a Python-level handler (run on
    # the main thread, woken by asyncio's signal wake-up fd), so every other thread is stopped
    # at a safe point meanwhile: faulthandler's C-level handler walked their frames while they
    # ran, and stalled mid-dump on a thread that was importing.
    signal.signal(signal.SIGUSR1, _dump_stacks)
    try:
        return asyncio.run(run_agent(config))
    except (OSError, RuntimeError) as exc:
        log.error("%s", exc)
        return 1


def _dump_stacks(signum: int, frame: object) -> None:
    faulthandler.dump_traceback(sys.stderr, all_threads=True)


if __name__ == "__main__":
    raise SystemExit(main())
