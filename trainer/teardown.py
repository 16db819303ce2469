"""Leaving a generation's world inside a surviving worker process.

After `destroy_process_group` and dropping the model, optimizer and mesh, the old DeviceMesh
(and with it gloo threads and sockets) stays reachable through process-wide caches in
torch.distributed: DTensor's sharding-propagation caches (Python and the C++ fast path), the
`functools` caches of redistribute planning and mesh topology, and others. Measured on this
machine: clearing only some of them does not free the mesh; clearing every cache under
torch.distributed does. This depends on torch internals, so it
lives in this module and a test checks threads, fds and sockets return to baseline.

The collections that free the old world must traverse every object the process holds, and after
`import torch` that is hundreds of thousands of them: two full collections were most of a
surviving worker's teardown. `freeze_import_heap` moves what exists at start-up (the imported
modules, never a generation's state) out of the collector's reach; what is left of the teardown
is mostly the freeing itself (docs/architecture.md, "Costs behind the code").

Until that freeing happens the old world's gloo connections
stay open: gloo has no abort, it closes a group's connections only when the group is freed. A
peer blocked on this rank (one whose collective waits for data from it, not from the dead rank)
would learn of the failure only then, later than the other survivors (the recovery benchmark
showed it), and the leader waits for every report. So a worker
whose gloo world failed first severs its connections (`sever_connections`): the peers' reads
then fail at once, as they would if this process had died, and the teardown follows.

With the connections severed, nothing needs the old world freed before the next join, only
unreachable from the new one: `Teardown` frees it after the next generation's first step.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribute-planning caches (they pin meshes):
    the next ops on any mesh propagate again, as in a new world."""
    clear_cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_cpp is not None:
        clear_cpp()
    try:
        from torch.distributed.tensor import DTensor, _redistribute
    except ImportError:
        return
    # A plain dict keyed by (weakref(mesh), meta) whose planners hold the mesh strongly.
    planners = getattr(_redistribute, "_planner_cache", None)
    if isinstance(planners, dict):
        planners.clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for attr in vars(propagator).values():
        clear = getattr(attr, "cache_clear", None)
        if callable(clear):
            clear()


def sever_connections() -> int:
    """Shut down this process's connected TCP sockets; how many. Call it only once a gloo world
    has failed and before anything else opens a TCP connection: a worker's only TCP sockets are
    then that world's (gloo's pairs, the generation's store), its agent link is a unix socket.
    The descriptors stay open for gloo to close when its groups are freed (never a reuse of a
    closed number). Linux only (it lists /proc/self/fd); elsewhere it does nothing."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    severed = 0
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue  # closed meanwhile (the fd that listed the directory is one)
        with socket.socket(fileno=dup) as sock:  # closes the duplicate only
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or \
                    sock.type != socket.SOCK_STREAM:
                continue
            with contextlib.suppress(OSError):  # OSError: listening, or not connected
                sock.getpeername()
                sock.shutdown(socket.SHUT_RDWR)
                severed += 1
    return severed


def freeze_import_heap() -> None:
    """Call once, after the imports and before the first generation (see the module docstring).

    Objects created later (models, groups, meshes, their cycles) are collected as before.
    """
    gc.collect()
    gc.freeze()


def _cache_clears(module: object) -> list[Callable[[], None]]:
    """The `cache_clear` of every functools cache of `module` and of its classes."""
    found = []
    for obj in list(vars(module).values()):
        targets = [obj]
        if isinstance(obj, type):
            targets = [getattr(v, "__func__", v) for v in vars(obj).values()]
        for target in targets:
            clear = getattr(target, "cache_clear", None)
            if callable(clear):
                found.append(clear)
    return found


class Teardown:
    """Leaving worlds, in two parts: `leave` before the next join, `release` once it trained.

    Freeing the old world (its gloo groups join their threads and close their sockets) took
    about half of a survivor's teardown, and finding torch.distributed's caches (a walk over
    every attribute of ~200 modules) most of the rest; both sat between a failure and the next
    join. So `leave` keeps the old world's process groups alive in `held`, clears the caches
    (known from `refresh`, which walks only modules it has not seen yet) and collects the old
    model and optimizer; `release` frees the groups, at the end of the next generation's first
    step or when this rank has no part in it.
    """

    def __init__(self) -> None:
        self._clears: list[Callable[[], None]] = []
        self._seen: set[str] = set()
        self.held: list[object] = []  # process groups of worlds left and not yet released

    def refresh(self) -> None:
        """Learn the caches of torch.distributed modules imported since the last call. Call it
        off the critical path: at start, and after a step (a step may import modules)."""
        with warnings.catch_warnings():  # touching deprecated module attributes warns
            warnings.simplefilter("ignore")
            for name, module in list(sys.modules.items()):
                if name in self._seen or module is None:
                    continue
                self._seen.add(name)
                if name.startswith("torch.distributed"):
                    self._clears.extend(_cache_clears(module))

    def leave(self) -> None:
        """Tear down the default process group and everything that pins it. Idempotent.

        Callers must drop their own references (model, optimizer, mesh, pending futures; keep
        only the error string of a failed collective, never the exception) before calling this.
        """
        if dist.is_initialized():
            self.held.extend(dist.distributed_c10d._world.pg_map)
            dist.destroy_process_group()
        # Unnamed groups are named by a process-wide counter that destroy_process_group resets,
        # but a join that failed inside init_process_group has already bumped it with no group
        # left to destroy. A survivor of such a join would then name its groups differently
        # from a fresh process and the next rendezvous would wait on keys nobody writes.
        dist.distributed_c10d._world.group_count = 0
        self.refresh()
        for clear in self._clears:
            with contextlib.suppress(TypeError):  # a class's cache_clear method: not a cache
                clear()
        clear_dtensor_caches()
        gc.collect()

    def release(self) -> None:
        """Free the worlds left so far (no-op when there are none)."""
        if self.held:
            self.held.clear()
            gc.collect()


def leave_world() -> None:
    """Leave the world and free it at once (`Teardown.leave` then `release`)."""
    teardown = Teardown()
    teardown.leave()
    teardown.release()
