"""`ultractl events --etcd HOST:PORT[,...] --job NAME`: a job's events read from etcd itself.

No agent is asked: this is how a plain torchrun job (`--rdzv-backend ultrascale`, whose run id
names its keys; docs/torchrun.md) shows its rendezvous rounds, and how a cluster whose agents are
all down still shows its history. The etcd flags mean what ultrad's do; the password comes from
a file only its owner may read.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.api.events import history
from daemon.control.etcd_client import Etcd
from daemon.control.etcd_security import EtcdSecurity, EtcdSecurityError
from daemon.control.keys import Keys


class EtcdEventsError(ValueError):
    """Bad flags: a usage error."""


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", metavar="HOST:PORT[,...]",
                   help="read the events from etcd, not from an agent (with --job)")
    p.add_argument("--job", metavar="NAME",
                   help="with --etcd: the job, or a plain torchrun job's --rdzv-id")
    for flag, what in (("--etcd-ca", "CA that verifies etcd"),
                       ("--etcd-cert", "client certificate for etcd"),
                       ("--etcd-key", "the client certificate's key"),
                       ("--etcd-password-file", "etcd user's password (a 0600 file)")):
        p.add_argument(flag, metavar="FILE", type=Path, help=what)
    p.add_argument("--etcd-user", default="", help="etcd user (with --etcd-password-file)")


def wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "etcd", None))


def _client(args: argparse.Namespace) -> tuple[Etcd, Keys]:
    if not args.job:
        raise EtcdEventsError("--etcd needs --job NAME (the job, or torchrun's --rdzv-id)")
    try:
        keys = Keys(args.job)
        security = EtcdSecurity(args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user,
                                args.etcd_password_file)
        return Etcd(args.etcd, timeout=args.timeout, security=security), keys
    except (EtcdSecurityError, ValueError) as exc:
        raise EtcdEventsError(str(exc)) from None


def stream(args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> None:
    """Each event as plain data, oldest first; with --follow, until interrupted. Raises
    EtcdUnreachable when no etcd member answered (nothing was read)."""
    async def go() -> None:
        etcd, keys = _client(args)
        try:
            await etcd.client.connect()
            async for event in history(etcd, keys, args.follow):
                emit(dataclasses.asdict(event))
        except EtcdSecurityError as exc:
            raise EtcdEventsError(str(exc)) from None
        finally:
            await etcd.close()

    asyncio.run(go())

