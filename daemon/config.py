"""The agent's configuration (what `ultrad` flags resolve to)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from checkpoint.snapshot_format import default_base
from daemon.control.etcd_security import EtcdSecurity


@dataclass(frozen=True)
class TLSConfig:
    cert: Path
    key: Path
    ca: Path | None = None  # set: require client certificates signed by it (mTLS)

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = self.ca.read_bytes() if self.ca else None
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class AgentConfig:
    node_id: str
    devices: int
    etcd: str
    device_memory: int = 0        # bytes per device for the planner's memory check; 0: unknown
    listen: str = "127.0.0.1:0"
    metrics_listen: str = "127.0.0.1:0"
    health_listen: str = ""       # plaintext grpc.health.v1 probes (daemon/api/probes.py); "": off
    state_dir: Path = Path("/var/lib/ultrad")
    job: str = "default"          # the etcd namespace: /ultrascale/<job>/
    job_file: Path | None = None  # a job to store at start unless one is stored already
    ttl: int = 5                  # lease TTL; every other timeout derives from it
    token_file: Path | None = None
    insecure: bool = False
    tls: TLSConfig | None = None
    etcd_security: EtcdSecurity = EtcdSecurity()  # TLS and user/password towards etcd
    advertise_host: str = ""      # host peers and workers use; default: api/advertise.py
    workers: bool = True          # False: control plane only (tests), no worker processes
    worker_module: str = "trainer.worker"
    # A spare worker per node, torch imported, that takes a dead worker's local rank at once.
    standby_worker: bool = True
    # How long workers keep training while etcd is unreachable for every agent (an outage in
    # which nobody can change membership); after that the agent fences itself.
    etcd_outage_s: float = 60.0
    # In-memory snapshots live in <snapshot_base>/<job>/<node>, every directory of it this
    # user's own, mode 0700 (docs/snapshots.md); default /dev/shm/ultrascale-<uid>.
    snapshot_base: Path = field(default_factory=default_base)
    # Directories a job's paths must lie under (parallel.job_paths); empty: the state dir.
    allowed_paths: tuple[Path, ...] = ()

    @property
    def job_roots(self) -> tuple[Path, ...]:
        return self.allowed_paths or (self.state_dir,)

    @property
    def debounce_s(self) -> float:
        # Batch a burst of joins into one generation without delaying a failure much.
        return min(0.5, self.ttl / 10)
