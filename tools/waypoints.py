"""Where tools/trace_generation.py's paths change task or process: (file relative to the
repository, function qualname), and the event at which tools/call_recorder.py keeps the stack."""

from __future__ import annotations

Where = tuple[str, str]

SCHEMA_DECODE: Where = ("daemon/control/schema.py", "decode")
VIEW_RUN: Where = ("daemon/control/view.py", "ClusterView.run")  # resumed by each watch batch
VIEW_NOTIFY: Where = ("daemon/control/view.py", "ClusterView._notify")
VIEW_WAIT: Where = ("daemon/control/view.py", "ClusterView.wait_for")
LEADER_ON_VIEW: Where = ("daemon/control/leader.py", "Leader._on_view")
LEADER_LOOP: Where = ("daemon/control/leader.py", "Leader._lead")
DECIDE: Where = ("daemon/control/decide.py", "decide")
FAILURE_REPORT: Where = ("daemon/node/workers.py", "NodeWorkers.report_failure")
PUT_REQUEST: Where = ("daemon/node/workers.py", "put_until_acknowledged")
ETCD_PUT: Where = ("daemon/control/etcd_client.py", "Etcd.put")
GET_GENERATION: Where = ("daemon/node/worker_service.py", "WorkerControlService.GetGeneration")
REPORT_FAILURE: Where = ("daemon/node/worker_service.py", "WorkerControlService.ReportFailure")
NEXT_GENERATION: Where = ("trainer/agent_link.py", "AgentLink.next_generation")
REPORT_FAILURE_CALL: Where = ("trainer/agent_link.py", "AgentLink.report_failure")
GENERATION_RUN: Where = ("trainer/generation.py", "Generation.run")
TRAIN_STEP: Where = ("trainer/loop.py", "Trainer.train_step")

# A return where the returned value tells which generation (or failure) it is; else the call.
WAYPOINTS: dict[Where, str] = {
    SCHEMA_DECODE: "return", GET_GENERATION: "return", NEXT_GENERATION: "return",
    GENERATION_RUN: "return",
    **{w: "call" for w in (VIEW_RUN, VIEW_NOTIFY, VIEW_WAIT, LEADER_ON_VIEW, LEADER_LOOP, DECIDE,
                           FAILURE_REPORT, PUT_REQUEST, ETCD_PUT, REPORT_FAILURE,
                           REPORT_FAILURE_CALL, TRAIN_STEP)},
}
