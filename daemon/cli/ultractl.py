"""ultractl: administer a cluster of ultrad agents.

    ultractl [GLOBAL FLAGS] COMMAND [ARGS] [GLOBAL FLAGS]
      status | nodes | job submit FILE [--set k=v]... [--replace]
      job cancel [--job NAME] | job get [-o toml|yaml|json]
      wait [--for=state=finished|cancelled|failed|running|pending] [--timeout SECONDS]
      logs NODE [--rank R] [--tail N] [-f]
      plan [--explain] [--world NODESxDEVICES] [--memory BYTES] [--free DIMS] [--job FILE]
      drain NODE | cordon NODE | uncordon NODE | checkpoint | events [-f]
      events [-f] --etcd HOST:PORT[,...] --job NAME [--etcd-ca F --etcd-cert F --etcd-key F]
             [--etcd-user U --etcd-password-file F]   (from etcd: no agent; plain torchrun jobs)
      config get-contexts | current-context | use-context NAME | delete-context NAME
             | set-context NAME [--endpoint A[,B...]] [--token-file F] [--tls-ca F]
      completion bash|zsh|fish | version [--client]

Global flags go before or after the command: --endpoint, --token-file, --tls-ca, --context,
--config, -o/--output table|json|yaml, --timeout, --insecure. Each field comes from its flag,
else its environment variable (ULTRA_ENDPOINT, ULTRA_TOKEN_FILE, ULTRA_TLS_CA, ULTRA_CONTEXT,
ULTRACTL_CONFIG, ULTRA_OUTPUT, ULTRA_TIMEOUT, ULTRA_INSECURE), else the context. The token goes
only to agents verified by TLS or on loopback (else --insecure). An endpoint may list several
agents (a,b,c); a context also remembers every member an agent reported. Data goes to stdout,
diagnostics to stderr. See docs/ultractl.md.
`plan` shows the live plan with the planner's predictions; `--world`/`--memory`/`--free` ask
what the layout search would choose on another world (with `--job FILE`, no cluster needed).
Exit codes: 0 ok, 1 failure (including a rejected request), 2 usage (bad flags, files or
config), 3 no agent could be reached (nothing was sent: safe to retry), 4 `wait --timeout`
passed first (`wait` gives 1 when the job reached another end state).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf.json_format import MessageToDict

from daemon.cli import completion, configcmd, etcd_events, lifecycle, versioncmd, whatif
from daemon.cli.ctlconfig import ContextError, config_path
from daemon.cli.ctlconnect import Agents, TargetError, TLSFiles, Unreachable, resolve_target
from daemon.cli.ctlerrors import EXIT_FAILURE, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, CtlError
from daemon.control.etcd_members import EtcdUnreachable
from parallel import job as jobmod
from parallel import mesh_dims
from parallel.cli_common import Parser, add_version
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb

_OUTPUTS = ("table", "json", "yaml")


def _env_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """The global flags' fallbacks, checked here since argparse does not check defaults."""
    output = env.get("ULTRA_OUTPUT") or "table"
    if output not in _OUTPUTS:
        raise CtlError(f"ULTRA_OUTPUT: expected one of {', '.join(_OUTPUTS)} (got {output!r})",
                       EXIT_USAGE)
    try:
        timeout = _seconds(env.get("ULTRA_TIMEOUT") or "10")
    except argparse.ArgumentTypeError as exc:
        raise CtlError(f"ULTRA_TIMEOUT: {exc}", EXIT_USAGE) from None
    return {"endpoint": env.get("ULTRA_ENDPOINT") or None,
            "token_file": env.get("ULTRA_TOKEN_FILE") or None,
            "tls_ca": env.get("ULTRA_TLS_CA") or None,
            "tls_cert": env.get("ULTRA_TLS_CERT") or None,
            "tls_key": env.get("ULTRA_TLS_KEY") or None,
            "insecure": env.get("ULTRA_INSECURE", "").lower() in ("1", "true", "yes", "on"),
            "context": env.get("ULTRA_CONTEXT", ""),
            "config": str(config_path(env)),
            "output": output, "timeout": timeout}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 (got {text!r})")
    return value


def _global_flags(p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None,
                  skip: Iterable[str] = ()) -> None:
    """The flags every command takes, before or after it (kubectl habit).

    The top-level parser holds the real defaults; a command's parser uses SUPPRESS, so a flag
    given after the command overrides the top level's value and an absent one leaves it alone.
    """
    def default(dest: str) -> Any:
        return defaults[dest] if defaults is not None else argparse.SUPPRESS

    flags: list[tuple[tuple[str, ...], dict[str, Any]]] = [
        (("--endpoint",), {"metavar": "HOST:PORT[,...]", "help": "agents to talk to"}),
        (("--token-file",), {"metavar": "FILE", "help": "bearer token file"}),
        (("--tls-ca",), {"metavar": "FILE", "help": "CA to verify the agents' TLS"}),
        (("--tls-cert",), {"metavar": "FILE",
                           "help": "client certificate (PEM) for agents that require one"}),
        (("--tls-key",), {"metavar": "FILE", "help": "the client certificate's key (PEM)"}),
        (("--insecure",), {"action": "store_true",
                           "help": "send the token in clear text to non-loopback endpoints "
                                   "named without TLS (never to discovered ones)"}),
        (("--context",), {"help": "context in the config file"}),
        (("--config",), {"metavar": "FILE", "help": "ultractl's config file"}),
        (("-o", "--output"), {"choices": _OUTPUTS, "help": "output format"}),
        (("--timeout",), {"type": _seconds, "metavar": "SECONDS",
                          "help": "deadline to reach an agent, and per call"}),
    ]
    skip = set(skip)
    for names, kwargs in flags:
        if not skip.intersection(names):
            dest = names[-1].lstrip("-").replace("-", "_")
            p.add_argument(*names, dest=dest, default=default(dest), **kwargs)


def _command_parser(own_flags: Iterable[str] = (), **kwargs: Any) -> argparse.ArgumentParser:
    """parser_class of every command: an ArgumentParser that takes the global flags too."""
    p = Parser(**kwargs)
    _global_flags(p, None, own_flags)
    return p


def _parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    p = Parser(prog="ultractl", description=__doc__)
    add_version(p, "ultractl")
    _global_flags(p, _env_defaults(os.environ if env is None else env))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=_command_parser)
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
    job = sub.add_parser("job", help="job commands").add_subparsers(
        dest="job_command", required=True, parser_class=_command_parser)
    submit = job.add_parser("submit", help="submit a job spec (TOML)")
    submit.add_argument("file")
    submit.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")
    submit.add_argument("--replace", action="store_true", help="replace the submitted job")
    lifecycle.add_job_parsers(job)
    for name in ("drain", "cordon", "uncordon"):
        sub.add_parser(name, help=f"{name} a node").add_argument("node")
    sub.add_parser("checkpoint", help="checkpoint at the next agreed step boundary")
    events = sub.add_parser("events", help="cluster events")
    events.add_argument("-f", "--follow", action="store_true")
    etcd_events.add_flags(events)
    lifecycle.add_parsers(sub)
    configcmd.add_parsers(sub, _command_parser)
    sub.add_parser("completion", help="print a shell completion script").add_argument(
        "shell", choices=completion.SHELLS)
    versioncmd.add_parser(sub)
    return p


def _connect(args: argparse.Namespace) -> tuple[Agents, tuple[tuple[str, str], ...]]:
    try:
        target = resolve_target(args.endpoint, args.token_file,
                                TLSFiles(args.tls_ca, args.tls_cert, args.tls_key),
                                args.context, Path(args.config), args.insecure)
    except TargetError as exc:
        raise CtlError(str(exc), EXIT_USAGE) from None
    agents = Agents(target, args.timeout)
    return agents, agents.metadata


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
        ["WORLD", f"{s['world_size']} ({' '.join(f'{k} {v}' for k, v in lay.items())})"],
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
                job = jobmod.load(args.job, overrides=args.overrides)
            except jobmod.ConfigError as exc:
                message = str(exc) if args.job in str(exc) else f"{args.job}: {exc}"
                raise CtlError(message, 2) from None
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
            elif wants_search:
                raise CtlError("no generation yet to search from: pass --job FILE", 1)
        if wants_search and job is not None and world is not None:
            # A job's search (a file's or the live one's) is over what it lets the daemon re-plan.
            free = free or job.parallel.replan
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
        if pred.get("snapshot_host_bytes"):
            yield (f"snapshots: {pred['snapshot_host_bytes'] / 1e9:.3f} GB of host memory per "
                   "node (its shards and its buddy's, 3 steps)")
    if "search" in plan:
        yield from whatif.render(plan["search"], explain)


def _print_event(d: dict[str, Any], out: str) -> None:
    """One event per line in every format, so `-f` output can be piped as it comes."""
    if out == "table":
        # A hang's stacks follow its failure line, indented.
        message = d["message"].replace("\n", "\n" + " " * 8)
        print(f"{d['revision']:>6}  {d['kind']:<14} {d['node'] or '-':<10} {message}",
              flush=True)
    else:
        print(json.dumps(d, sort_keys=True) if out == "json"
              else yaml.safe_dump([d], sort_keys=True), end="\n" if out == "json" else "",
              flush=True)


def run(args: argparse.Namespace) -> int:
    if args.command == "plan":
        return _plan(args)
    if args.command == "completion":
        print(completion.script(args.shell, "ultractl", _parser()), end="")
        return EXIT_OK
    if args.command == "version":
        return versioncmd.run(args, lambda: _connect(args), _emit)
    if args.command == "config":
        try:
            return configcmd.run(args, Path(args.config), _emit)
        except ContextError as exc:
            raise CtlError(str(exc), EXIT_USAGE) from None
    if args.command == "events" and etcd_events.wanted(args):
        try:
            etcd_events.stream(args, lambda d: _print_event(d, args.output))
        except etcd_events.EtcdEventsError as exc:
            raise CtlError(str(exc), EXIT_USAGE) from None
        except EtcdUnreachable as exc:
            raise Unreachable(str(exc)) from None
        return EXIT_OK
    lifecycle_run = lifecycle.command(args, _emit)  # its flags are checked before connecting
    stub, md = _connect(args)
    t, out = args.timeout, args.output
    if lifecycle_run is not None:
        return lifecycle_run(stub, md)
    if args.command == "status":
        s = _dict(stub.GetStatus(pb.GetStatusRequest(), timeout=t, metadata=md))
        s["layout"] = {k: s["layout"].get(k, 0) for k in mesh_dims.NAMES}
        _emit(s, out, _status_table)
    elif args.command == "nodes":
        reply = stub.ListNodes(pb.ListNodesRequest(), timeout=t, metadata=md)
        _emit([_dict(n) for n in reply.nodes], out, _nodes_table)
    elif args.command == "job":
        try:
            text = Path(args.file).read_text()
        except OSError as exc:
            raise CtlError(f"{args.file}: {exc.strerror}", EXIT_USAGE) from None
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
            _print_event(_dict(ev), out)
    return 0


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    try:
        args = _parser(env).parse_args(argv)
        return run(args)
    except SystemExit as exc:  # argparse: usage errors (2), --help (0)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except CtlError as exc:
        print(f"ultractl: {exc}", file=sys.stderr)
        return exc.code
    except Unreachable as exc:
        print(f"ultractl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        print(f"ultractl: {code.name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
