"""Records where a traced process's own code runs, for tools/trace_generation.py.

`arm(directory)` waits until the process imports its entry module (the agent's
`daemon.agent`, the worker's `trainer.generation`: after torch, whose import would otherwise be
profiled too), then profiles every thread with `sys.setprofile`. Each call into a file of this
repository (tools/ and .venv excluded) becomes one JSON line in `<directory>/<pid>.jsonl`:
time (CLOCK_MONOTONIC, shared by the processes of one host), thread, the frame and its
caller's frame, file and function (a coroutine's resumption is a call too). At the
waypoints that tools/trace_generation.py follows (tools/waypoints.py: a call or a return)
the line also carries the stack of this repository's frames, the type of the returned value,
and the generation (and node) that the returned value or a local names.
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from tools.waypoints import WAYPOINTS, Where

ROOT = Path(__file__).resolve().parent.parent
ENTRY_MODULES = frozenset({"daemon.agent", "trainer.generation"})


class Recorder:
    def __init__(self, directory: Path,
                 waypoints: dict[Where, str] | None = None) -> None:
        self.waypoints = WAYPOINTS if waypoints is None else waypoints
        self.out = (directory / f"{os.getpid()}.jsonl").open("w", buffering=1 << 16)
        self.files: dict[str, str | None] = {}  # co_filename -> path relative to ROOT, or None
        self.lock = threading.Lock()
        self.write({"process": os.getpid(), "parent": os.getppid(), "argv": sys.argv,
                    "node": os.environ.get("ULTRA_NODE_ID", ""),
                    "local_rank": os.environ.get("ULTRA_LOCAL_RANK", "")})
        atexit.register(self.close)

    def write(self, record: dict[str, Any], flush: bool = False) -> None:
        with self.lock:
            self.out.write(json.dumps(record) + "\n")
            if flush:
                self.out.flush()

    def close(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)
        with self.lock:
            self.out.close()

    def relative(self, filename: str) -> str | None:
        rel = self.files.get(filename, "")
        if rel == "":
            rel = None
            if filename.startswith(str(ROOT) + os.sep):
                rel = filename[len(str(ROOT)) + 1:]
                if rel.startswith(("tools/", ".venv/")):
                    rel = None
            self.files[filename] = rel
        return rel

    def stack(self, frame: FrameType | None) -> list[list[Any]]:
        out = []
        while frame is not None:
            rel = self.relative(frame.f_code.co_filename)
            if rel is not None:
                out.append([id(frame), rel, frame.f_code.co_qualname])
            frame = frame.f_back
        return out[::-1]  # root first

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" and event != "return":
            return
        code = frame.f_code
        rel = self.relative(code.co_filename)
        if rel is None:
            return
        point = self.waypoints.get((rel, code.co_qualname))
        if event == "return" and point != "return":
            return
        caller = frame.f_back
        record: dict[str, Any] = {"t": time.monotonic_ns(), "thread": threading.get_ident(),
                                  "event": event, "frame": id(frame), "caller": id(caller),
                                  "caller_function": caller.f_code.co_qualname if caller else "",
                                  "file": rel, "function": code.co_qualname}
        if point == event:
            record["stack"] = self.stack(frame)
            record["value"] = type(arg).__name__ if event == "return" else ""
            named = [arg] if event == "return" else []
            named += list(frame.f_locals.values())
            subject = next((v for v in named if isinstance(getattr(v, "generation", None), int)),
                           None)
            if subject is not None:
                record["generation"] = subject.generation
                node = getattr(subject, "node", None)
                if isinstance(node, str):
                    record["node"] = node
        self.write(record, flush=point == event)


class _ArmOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name in ENTRY_MODULES:
            sys.meta_path.remove(self)
            sys.setprofile(self.recorder.profile)
            threading.setprofile(self.recorder.profile)
        return None  # the usual finders import it


def arm(directory: str) -> None:
    sys.meta_path.insert(0, _ArmOnImport(Recorder(Path(directory))))
