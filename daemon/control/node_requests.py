"""Admin requests that name this node (drain, cordon, uncordon): applied to its membership
record, then consumed."""

from __future__ import annotations

import logging

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.keys import Keys
from daemon.control.membership import Membership
from daemon.control.records import ControlOp
from daemon.control.view import ClusterView

log = logging.getLogger(__name__)


async def apply_node_requests(node: str, view: ClusterView, membership: Membership, etcd: Etcd,
                              keys: Keys) -> bool:
    """Apply the requests in the view that name `node`, then delete them. False: etcd failed
    (the caller tries again at the next change)."""
    for request_id, request in list(view.control.items()):
        if request.node != node or not request.op.node_op:
            continue
        state = request.op.node_state
        try:
            if membership.record.state != state:
                await membership.set_state(state)
                log.info("node state -> %s (%s)", state.value, request_id)
            if request.op == ControlOp.UNCORDON:
                await etcd.delete(keys.cordon(node))
            await etcd.delete(keys.control_request(request_id))
        except ETCD_ERRORS as exc:
            log.warning("could not apply %s: %s", request_id, exc)
            return False
    return True
