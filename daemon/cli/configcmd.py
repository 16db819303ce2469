"""`ultractl config ...`: the contexts in ultractl's config file, with kubectl's verbs.

    get-contexts              every context; `*` marks the current one (-o json|yaml: all keys)
    current-context           the current context's name (exit 1 when none is set)
    use-context NAME          make NAME current
    set-context NAME [--endpoint A[,B...]] [--token-file F] [--tls-ca F]
                [--tls-cert F --tls-key F]
                              create NAME, or change only the given fields of it
    delete-context NAME
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from daemon.cli import ctlconfig

# set-context's own flags, and the key each writes in the context.
CONTEXT_FIELDS = {"--endpoint": "endpoint", "--token-file": "token-file", "--tls-ca": "tls-ca",
                  "--tls-cert": "tls-cert", "--tls-key": "tls-key"}


def add_parsers(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
                parser_class: Callable[..., argparse.ArgumentParser]) -> None:
    cfg = sub.add_parser("config", help="contexts: get-contexts, use-context, set-context, ...")
    verbs = cfg.add_subparsers(dest="config_command", required=True, metavar="VERB",
                               parser_class=parser_class)
    verbs.add_parser("get-contexts", help="list the contexts (* = current)")
    verbs.add_parser("current-context", help="print the current context's name")
    verbs.add_parser("use-context", help="make a context current").add_argument("name")
    verbs.add_parser("delete-context", help="remove a context").add_argument("name")
    # Its endpoint and credentials are what it stores, so the global flags of the same
    # names (and their environment fallbacks) must not feed it.
    setc = verbs.add_parser("set-context", help="create or change a context",
                            own_flags=tuple(CONTEXT_FIELDS))
    setc.add_argument("name")
    for flag, key in CONTEXT_FIELDS.items():
        setc.add_argument(flag, dest=f"set_{key.replace('-', '_')}", default=None,
                          help=f"the context's {key} (an empty value removes it)"
                          if flag != "--endpoint" else "the agents, HOST:PORT[,HOST:PORT...]")


def _rows(rows: Iterable[ctlconfig.ContextRow]) -> list[dict[str, Any]]:
    return [{"name": r.name, "current": r.current, **r.entry} for r in rows]


def _table(rows: list[dict[str, Any]]) -> Iterable[str]:
    table = [["CURRENT", "NAME", "ENDPOINT", "DISCOVERED", "TOKEN-FILE", "TLS-CA"]]
    table += [["*" if r["current"] else "", r["name"], str(r.get("endpoint", "")),
               str(len(r.get("discovered") or [])), str(r.get("token-file") or ""),
               str(r.get("tls-ca") or "")] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        yield "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()


def run(args: argparse.Namespace, path: Path,
        emit: Callable[[Any, str, Callable[[Any], Iterable[str]]], None]) -> int:
    """0, or 1 when `current-context` finds none set. Raises ctlconfig.ContextError."""
    verb = args.config_command
    if verb == "get-contexts":
        _, rows = ctlconfig.list_contexts(path)
        emit(_rows(rows), args.output, _table)
    elif verb == "current-context":
        current, _ = ctlconfig.list_contexts(path)
        if not current:
            print(f"ultractl: current-context is not set in {path}", file=sys.stderr)
            return 1
        print(current)
    elif verb == "use-context":
        ctlconfig.use_context(path, args.name)
        print(f'switched to context "{args.name}"')
    elif verb == "delete-context":
        ctlconfig.delete_context(path, args.name)
        print(f'deleted context "{args.name}" from {path}')
    elif verb == "set-context":
        fields = {key: getattr(args, f"set_{key.replace('-', '_')}")
                  for key in CONTEXT_FIELDS.values()}
        created = ctlconfig.set_context(path, args.name, fields)
        print(f'context "{args.name}" {"created" if created else "modified"}')
    return 0
