"""The job lifecycle RPCs beside SubmitJob: CancelJob and GetJob (ultractl job cancel|get)."""

from __future__ import annotations

import json
import time
import uuid

import grpc

from daemon.control.etcd_client import Etcd
from daemon.control.job_state import job_state
from daemon.control.keys import Keys
from daemon.control.records import ENDED, ControlOp, ControlRequest, JobState
from daemon.control.view import ClusterView
from proto.ultrascale.v1 import agent_pb2 as pb


def job_name(view: ClusterView) -> str:
    return str(view.job_spec.config.get("job", {}).get("name", "")) if view.spec else ""


async def cancel_job(view: ClusterView, etcd: Etcd, keys: Keys, request: pb.CancelJobRequest,
                     context: grpc.aio.ServicerContext) -> pb.CancelJobResponse:
    """Write the cancel request the leader consumes (decide.py); refused when there is nothing
    to cancel, or when `request.job` names another job than the submitted one."""
    if view.spec is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no job submitted")
    assert view.spec is not None
    name, revision = job_name(view), view.spec.mod_revision
    if request.job and request.job != name:
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"job: no job named {request.job!r} (submitted: {name!r})")
    state, _ = job_state(view)
    if state in ENDED:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"job {name!r} has already ended ({state.value})")
    request_id = f"cancel-{uuid.uuid4().hex[:12]}"
    await etcd.put(keys.control_request(request_id),
                   ControlRequest(op=ControlOp.CANCEL, spec_revision=revision,
                                  time=time.time()).to_json())
    return pb.CancelJobResponse(job=name, revision=revision, request_id=request_id)


async def get_job(view: ClusterView, context: grpc.aio.ServicerContext) -> pb.JobSpec:
    if view.spec is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no job submitted")
    assert view.spec is not None
    spec = view.job_spec
    state: JobState = job_state(view)[0]
    return pb.JobSpec(job=job_name(view), revision=view.spec.mod_revision, spec_toml=spec.toml,
                      overrides=list(spec.overrides),
                      config_json=json.dumps(spec.config, sort_keys=True),
                      submitted_at=spec.submitted_at, state=state.value)
