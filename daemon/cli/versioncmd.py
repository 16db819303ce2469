"""`ultractl version [--client]`: ultractl's version and each agent's.

The agents' come from their node records (ListNodes), so one reachable agent answers for every
member. The client's line is printed first in any case; when no agent can be asked (no
endpoint configured, none reachable) the error follows on stderr with ultractl's exit code for
it (2, 3), as for any other command. `--client` asks no agent; `ultractl --version` is the same
as `ultractl version --client` in one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from parallel.cli_common import version
from proto.ultrascale.v1 import agent_pb2 as pb

Emit = Callable[[Any, str, Callable[[Any], Iterable[str]]], None]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("version", help="ultractl's version and the agents'")
    p.add_argument("--client", action="store_true", help="only ultractl's own (asks no agent)")


def _table(data: dict[str, Any]) -> Iterable[str]:
    rows = [("COMPONENT", "VERSION"), ("ultractl", data["client"])]
    rows += [(f"ultrad {node}", v) for node, v in sorted(data.get("agents", {}).items())]
    width = max(len(name) for name, _ in rows)
    for name, v in rows:
        yield f"{name.ljust(width)}  {v}"


def run(args: argparse.Namespace, connect: Callable[[], tuple[Any, Any]], emit: Emit) -> int:
    """0; the errors of `connect` and of the call propagate after the client's version."""
    data: dict[str, Any] = {"client": version()}
    try:
        if not args.client:
            agents, metadata = connect()
            reply = agents.ListNodes(pb.ListNodesRequest(), timeout=args.timeout,
                                     metadata=metadata)
            data["agents"] = {n.node: n.version or "unknown" for n in reply.nodes}
    finally:
        emit(data, args.output, _table)
    return 0
