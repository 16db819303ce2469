"""`torchrun --rdzv-backend ultrascale`: torch's dynamic rendezvous over our etcd v3 backend.

torchrun finds this through the `torchrun.handlers` entry point (pyproject.toml,
daemon/rendezvous/__init__.py), which calls `create_rdzv_handler`.
The handler is torch's own DynamicRendezvousHandler (rounds, min:max nodes, last call,
heartbeats, restarts) on `EtcdRendezvousBackend` and `EtcdStore`, both on the agents' etcd
client and key schema (`/ultrascale/<run id>/rendezvous/`).
"""

from __future__ import annotations

import grpc
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from daemon.control.etcd_members import EtcdUnreachable
from daemon.control.etcd_sync import SyncEtcd
from daemon.control.keys import Keys
from daemon.rendezvous.backend import EtcdRendezvousBackend
from daemon.rendezvous.conf import RendezvousConf, RendezvousConfError, parse
from daemon.rendezvous.store import EtcdStore


def connect(conf: RendezvousConf) -> SyncEtcd:
    """The run's etcd client, having reached a member; a refusal or no answer is a
    RendezvousConfError naming the option to check."""
    etcd = SyncEtcd(conf.endpoints, timeout=conf.etcd_timeout, security=conf.security)
    try:
        etcd.connect()
    except EtcdUnreachable as exc:
        etcd.close()
        raise RendezvousConfError(f"--rdzv-endpoint {conf.endpoints}: {exc}") from None
    except grpc.aio.AioRpcError as exc:
        etcd.close()
        what = "user=/password_file=" if conf.security.user else "--rdzv-endpoint"
        raise RendezvousConfError(f"--rdzv-conf {what}: etcd refused: {exc.code().name}: "
                                  f"{exc.details()}") from None
    return etcd


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """A handler for torchrun's parameters; RendezvousConfError names a bad option."""
    conf = parse(params.endpoint, params.run_id, params.config)
    etcd = connect(conf)
    keys = Keys(conf.run_id)
    backend = EtcdRendezvousBackend(etcd, keys, params.min_nodes, params.max_nodes)
    store = EtcdStore(etcd, keys.rendezvous_store)
    torch_params = RendezvousParameters(
        backend=params.backend, endpoint=params.endpoint, run_id=params.run_id,
        min_nodes=params.min_nodes, max_nodes=params.max_nodes, local_addr=params.local_addr,
        **dict(conf.torch_options))
    return create_handler(store, backend, torch_params)
