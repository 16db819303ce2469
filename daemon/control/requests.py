"""Writing a control request that must arrive (a failure report): retried until etcd
acknowledges it or it no longer matters."""

from __future__ import annotations

import logging
from collections.abc import Callable

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.records import ControlRequest
from daemon.tasks import Backoff

log = logging.getLogger(__name__)


async def put_until_acknowledged(etcd: Etcd, key: bytes, request: ControlRequest,
                                 still_wanted: Callable[[], bool]) -> None:
    backoff = Backoff(initial=0.1, maximum=2.0)
    while still_wanted():
        try:
            await etcd.put(key, request.to_json())
            return
        except ETCD_ERRORS as exc:
            log.warning("request %s not recorded yet (%s); retrying", key.decode(errors="replace"),
                        type(exc).__name__)
            await backoff.sleep()
