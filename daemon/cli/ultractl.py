"""ultractl: administer a cluster of ultrad agents.

    ultractl [-o table|json|yaml] [--endpoint ADDR] [--token-file F] [--context NAME]
             [--tls-ca F] [--tls-cert F --tls-key F] COMMAND
      status | nodes | job submit FILE [--set k=v]... [--replace]
      plan [--explain] [--world NODESxDEVICES] [--memory BYTES] [--free DIMS] [--job FILE]
      drain NODE | cordon NODE | uncordon NODE | checkpoint | events [-f]

Endpoint, token and TLS files come from the flags, else ULTRA_ENDPOINT / ULTRA_TOKEN_FILE /
ULTRA_TLS_CA / ULTRA_TLS_CERT / ULTRA_TLS_KEY, else the context (--context, ULTRA_CONTEXT or
the config's current-context) in $XDG_CONFIG_HOME/ultrascale/config. An endpoint may list
several agents (a,b,c): the first that answers is used. `-o` goes before or after the command. Data goes to stdout,
diagnostics to stderr.
`plan` shows the live plan with the planner's predictions; `--world`/`--memory`/`--free` ask
what the layout search would choose on another world (with `--job FILE`, no cluster needed).
Exit codes: 0 ok, 1 failure (including a rejected request), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf.json_format import MessageToDict

from daemon.api.auth import call_metadata
from daemon.cli import whatif
from daemon.cli.ctlconfig import ContextError, config_path, load_context
from daemon.secret_files import SecretFileError, read_secret
from daemon.tls_files import TLSFileError, client_credentials
from parallel import job as jobmod
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

_OUTPUTS = ("table", "json", "yaml")


class CtlError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ultractl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    p.add_argument("--endpoint", default=env("ULTRA_ENDPOINT"), help="agent host:port")
    p.add_argument("--token-file", default=env("ULTRA_TOKEN_FILE"), help="bearer token file")
    p.add_argument("--context", default=env("ULTRA_CONTEXT", ""), help="context in the config")
    p.add_argument("--tls-ca", default=env("ULTRA_TLS_CA"), help="CA to verify the agent's TLS")
    p.add_argument("--tls-cert", default=env("ULTRA_TLS_CERT"),
                   help="client certificate (PEM) for agents that require one (mTLS)")
    p.add_argument("--tls-key", default=env("ULTRA_TLS_KEY"), help="its private key (PEM)")
    p.add_argument("-o", "--output", choices=_OUTPUTS, default=env("ULTRA_OUTPUT", "table"))
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    # kubectl habit: `ultractl nodes -o json` as well as `ultractl -o json nodes`.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--output", choices=_OUTPUTS, default=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=lambda **kw: argparse.ArgumentParser(
                               parents=[common], **kw))
    sub.add_parser("status", help="the job and the cluster at a glance")
    sub.add_parser("nodes", help="members and their state")
    plan = sub.add_parser("plan", help="the current generation plan, with predictions")
    plan.add_argument("--explain", action="store_true",
                      help="list the next-best layouts and why the others are invalid")
    plan.add_argument("--world", help="what-if: search a world of NODESxDEVICES")
    plan.add_argument("--memory", help="bytes per device for the search (80G, 24GiB); "
                                       "default 80G")
    plan.add_argument("--free", default="", help="dimensions the search may change "
                                                 "(tp,pp,cp,zero,recompute,micro_batch,...)")
    plan.add_argument("--job", help="a job file instead of the live job (no cluster needed)")
    plan.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY=VALUE", help="override a --job field")
    job = sub.add_parser("job", help="job commands").add_subparsers(dest="job_command",
                                                                    required=True)
    submit = job.add_parser("submit", help="submit a job spec (TOML)")
    submit.add_argument("file")
    submit.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")
    submit.add_argument("--replace", action="store_true", help="replace the submitted job")
    for name in ("drain", "cordon", "uncordon"):
        sub.add_parser(name, help=f"{name} a node").add_argument("node")
    sub.add_parser("checkpoint", help="checkpoint at the next agreed step boundary")
    events = sub.add_parser("events", help="cluster events")
    events.add_argument("-f", "--follow", action="store_true")
    return p


def _connect(args: argparse.Namespace) -> tuple[pb_grpc.AgentStub, tuple[tuple[str, str], ...]]:
    endpoint, token_file, ca = args.endpoint, args.token_file, args.tls_ca
    cert, key = args.tls_cert, args.tls_key
    if not endpoint or not token_file:
        try:
            ctx = load_context(config_path(), args.context)
        except ContextError as exc:
            raise CtlError(str(exc), 2) from None
        if ctx is not None:
            endpoint, token_file = endpoint or ctx.endpoint, token_file or ctx.token_file
            ca = ca or ctx.tls_ca or None
            if not cert and not key:
                cert, key = ctx.tls_cert or None, ctx.tls_key or None
    if not endpoint:
        raise CtlError("no endpoint: pass --endpoint, set ULTRA_ENDPOINT, or configure a "
                       f"context in {config_path()}", 2)
    token = ""
    if token_file:
        try:
            token = read_secret(Path(token_file).expanduser(), "--token-file")
        except SecretFileError as exc:
            raise CtlError(str(exc), 2) from None
    creds = None
    if ca or cert or key:
        try:
            creds = client_credentials(Path(ca) if ca else None, Path(cert) if cert else None,
                                       Path(key) if key else None)
        except TLSFileError as exc:
            raise CtlError(str(exc), 2) from None
    endpoints = [e.strip() for e in endpoint.split(",") if e.strip()]
    return _FailoverStub(endpoints, creds), call_metadata(token) if token else ()


class _FailoverStub:
    """An AgentStub over several endpoints: each call goes to the first agent that answers."""

    def __init__(self, endpoints: list[str], creds: grpc.ChannelCredentials | None) -> None:
        self._stubs = [pb_grpc.AgentStub(grpc.secure_channel(e, creds) if creds
                                         else grpc.insecure_channel(e)) for e in endpoints]

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            error: grpc.RpcError | None = None
            for stub in self._stubs:
                try:
                    reply = getattr(stub, method)(*args, **kwargs)
                    if method == "WatchEvents":
                        # A stream fails on its first message, not at the call.
                        first = next(iter(reply), None)
                        return _chain(first, reply)
                    return reply
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                        raise
                    error = exc
            assert error is not None
            raise error
        return call


def _chain(first: Any, rest: Iterable[Any]) -> Iterable[Any]:
    if first is not None:
        yield first
        yield from rest


def _dict(message: Any) -> dict[str, Any]:
    """A message as plain data; int64 fields stay numbers (proto3 JSON makes them strings)."""
    data = MessageToDict(message, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
    for fd in message.DESCRIPTOR.fields:
        if fd.name not in data:
            continue
        if fd.message_type is not None and not fd.is_repeated:
            data[fd.name] = _dict(getattr(message, fd.name))
        elif fd.cpp_type in (fd.CPPTYPE_INT64, fd.CPPTYPE_UINT64):
            data[fd.name] = int(data[fd.name])
    return data


def _emit(data: Any, output: str, table: Callable[[Any], Iterable[str]]) -> None:
    if output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    elif output == "yaml":
        print(yaml.safe_dump(data, sort_keys=True), end="")
    else:
        for line in table(data):
            print(line)


def _columns(rows: list[list[str]]) -> Iterable[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        yield "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()


def _status_table(s: dict[str, Any]) -> Iterable[str]:
    lay = s["layout"]
    yield from _columns([
        ["JOB", s["job"] or "-"], ["STATE", s["state"]], ["REASON", s["reason"] or "-"],
        ["AGENT", f"{s['node']} ({s['agent_state']})"],
        ["GENERATION", str(s["generation"])],
        ["STEP", str(s["step"])], ["LOSS", f"{s['loss']:.4f}"],
        ["WORLD", f"{s['world_size']} (dp {lay['dp']} tp {lay['tp']} pp {lay['pp']} "
                  f"cp {lay['cp']})"],
        ["LEADER", s["leader"] or "-"], ["NODES", str(s["nodes"])],
        ["FINISHED", "yes" if s["finished"] else "no"],
    ])


def _nodes_table(nodes: list[dict[str, Any]]) -> Iterable[str]:
    rows = [["NODE", "ADDRESS", "DEVICES", "STATE", "PID", "LEADER", "METRICS"]]
    rows += [[n["node"], n["address"], str(n["devices"]), n["state"], str(n["pid"]),
              "*" if n["leader"] else "", n["metrics_url"]] for n in nodes]
    return _columns(rows)


def _plan_table(plan: dict[str, Any]) -> Iterable[str]:
    if plan.get("state") in ("pending", "failed"):
        yield f"job {plan['state']}: {plan.get('job_reason') or '-'}"
    if "layout" not in plan:
        yield "no generation yet"
        return
    lay = plan["layout"]
    yield (f"generation {plan['generation']} ({plan.get('reason', '')}): world "
           f"{len(plan['ranks'])}, dp {lay['dp']} tp {lay['tp']} pp {lay['pp']} cp {lay['cp']}, "
           f"grad_accum {lay['grad_accum']}; store {plan['store']['host']}:"
           f"{plan['store']['port']}; restore {plan['restore']['source']}@"
           f"{plan['restore']['step']}")
    if plan.get("layout_reason"):
        yield f"layout: {plan['layout_reason']}"
    if plan.get("idle"):
        yield f"idle: {', '.join(plan['idle'])}"
    yield from _columns([["RANK", "NODE", "LOCAL_RANK"]] + [
        [str(r["global_rank"]), r["node"], str(r["local_rank"])] for r in plan["ranks"]])


def _plan(args: argparse.Namespace) -> int:
    """0, or 1 when a layout search found no valid layout (the reasons are printed)."""
    wants_search = bool(args.world or args.memory or args.free or args.explain or args.job)
    plan: dict[str, Any] = {}
    job = None
    try:
        memory = whatif.parse_bytes(args.memory) if args.memory else whatif.DEFAULT_MEMORY
        free = whatif.parse_free(args.free)
        world = whatif.parse_world(args.world) if args.world else None
        if args.job:
            try:
                job = jobmod.loads(Path(args.job).read_text(), overrides=args.overrides)
            except OSError as exc:
                raise CtlError(f"{args.job}: {exc.strerror}", 2) from None
            except jobmod.ConfigError as exc:
                raise CtlError(f"{args.job}: {exc}", 2) from None
            if world is None:
                raise CtlError("--job needs --world NODESxDEVICES", 2)
        else:
            stub, md = _connect(args)
            reply = stub.GetPlan(pb.GetPlanRequest(), timeout=args.timeout, metadata=md)
            plan = json.loads(reply.plan_json) if reply.plan_json else {}
            # The job's state rides along; the plan's own `reason` says why it was made.
            plan.update({"state": reply.state, "job_reason": reply.reason})
            if "layout" in plan:
                live = Plan.from_dict(plan)
                job = live.job
                here = whatif.world_of(plan["ranks"])
                plan["model_prediction"] = whatif.predict(job, live.layout, here.devices_per_node)
                world = world or here
                # The live job's search is over what it lets the daemon re-plan.
                free = free or job.parallel.replan
            elif wants_search:
                raise CtlError("no generation yet to search from: pass --job FILE", 1)
        if wants_search and job is not None and world is not None:
            plan["search"] = whatif.search(job, world, memory, free)
    except whatif.WhatIfError as exc:
        raise CtlError(str(exc), 2) from None
    _emit(plan, args.output, lambda p: _plan_lines(p, args.explain))
    return 1 if "search" in plan and plan["search"]["best"] is None else 0


def _plan_lines(plan: dict[str, Any], explain: bool) -> Iterable[str]:
    if "layout" in plan or "state" in plan:
        yield from _plan_table(plan)
    pred = plan.get("model_prediction")
    if pred:
        m = pred["memory_bytes"]
        yield (f"predicted: {m['total'] / 1e9:.3f} GB per device (params "
               f"{m['params'] / 1e9:.3f}, grads {m['grads'] / 1e9:.3f}, optimizer "
               f"{m['optimizer'] / 1e9:.3f}, activations {m['activations'] / 1e9:.3f}); "
               f"bubble {pred['bubble_ratio']:.3f}, recompute {pred['recompute_ratio']:.3f}")
    if "search" in plan:
        yield from whatif.render(plan["search"], explain)


def run(args: argparse.Namespace) -> int:
    if args.command == "plan":
        return _plan(args)
    stub, md = _connect(args)
    t, out = args.timeout, args.output
    if args.command == "status":
        s = _dict(stub.GetStatus(pb.GetStatusRequest(), timeout=t, metadata=md))
        s["layout"] = {k: s["layout"].get(k, 0) for k in ("dp", "tp", "pp", "cp")}
        _emit(s, out, _status_table)
    elif args.command == "nodes":
        reply = stub.ListNodes(pb.ListNodesRequest(), timeout=t, metadata=md)
        _emit([_dict(n) for n in reply.nodes], out, _nodes_table)
    elif args.command == "job":
        try:
            text = Path(args.file).read_text()
        except OSError as exc:
            raise CtlError(f"{args.file}: {exc.strerror}") from None
        reply = stub.SubmitJob(pb.SubmitJobRequest(spec_toml=text, overrides=args.overrides,
                                                   replace=args.replace), timeout=t, metadata=md)
        _emit(_dict(reply), out, lambda r: [f"job {r['job']} submitted "
                                            f"(revision {r['revision']})"])
    elif args.command in ("drain", "cordon", "uncordon"):
        call = {"drain": stub.Drain, "cordon": stub.Cordon, "uncordon": stub.Uncordon}
        reply = call[args.command](pb.NodeRequest(node=args.node), timeout=t, metadata=md)
        _emit(_dict(reply), out, lambda r: [f"node {r['node']}: {r['state']}"])
    elif args.command == "checkpoint":
        reply = stub.Checkpoint(pb.CheckpointRequest(), timeout=t, metadata=md)
        _emit(_dict(reply), out, lambda r: [f"checkpoint requested ({r['request_id']})"])
    elif args.command == "events":
        stream = stub.WatchEvents(pb.WatchEventsRequest(follow=args.follow),
                                  timeout=None if args.follow else t, metadata=md)
        for ev in stream:
            # One event per line in every format, so `-f` output can be piped as it comes.
            d = _dict(ev)
            if out == "table":
                print(f"{d['revision']:>6}  {d['kind']:<14} {d['node'] or '-':<10} "
                      f"{d['message']}", flush=True)
            else:
                print(json.dumps(d, sort_keys=True) if out == "json"
                      else yaml.safe_dump([d], sort_keys=True), end="\n" if out == "json" else "",
                      flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except CtlError as exc:
        print(f"ultractl: {exc}", file=sys.stderr)
        return exc.code
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        print(f"ultractl: {code.name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
