"""Trace a generation change and a failure report through the code, file by file.

    python -m tools.trace_generation [--keep]

Runs the recovery benchmark's job once (`bench.recovery`, arm `ultrad-kill-worker`: three
nodes, one worker each; the worker of a node that does not lead is killed) with every agent and
worker recording its calls into this repository's files (tools/call_recorder.py, armed through
tools/trace_hook/sitecustomize.py). Then it follows, on the third node (a survivor that does
not lead, whose agent learns of a new generation from its etcd watch alone; the generation's
path is followed on the other two nodes as well, the victim's worker being the standby that took
the killed worker's rank):

- the new generation g+1: the agent's watch task, resumed with the batch that holds g+1's
  plan, up to the view waking its waiters; the `GetGeneration` handler of the surviving worker,
  from where the view wakes it (or finds g+1 already there) to its answer; the worker, from
  `AgentLink.next_generation` returning g+1 to its first call of `Trainer.train_step`;
- its worker's failure in generation g: from `Generation.run` raising into `run_one` to the
  report's call to the agent; the agent's `ReportFailure` handler to the report's hand-off to
  a task; that task's etcd put; the leader agent's watch task, resumed with the batch that
  holds the report, up to the view telling the leader; the leader's loop, from its wake-up to
  its call of `decide`.

Where the path changes task or process (the waypoints above) is named here; the files between
are whatever the interpreter's stacks show. A segment's main line is the chain of frames from
where it is woken to where it hands off: the frames it returns through, then those it calls
down (frames matched by identity). Calls from live main-line frames into other files that come
back before the hand-off are side trips, listed apart. A file the line enters again after
leaving it for another file is a return.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.waypoints import (
    DECIDE,
    ETCD_PUT,
    FAILURE_REPORT,
    GENERATION_RUN,
    GET_GENERATION,
    LEADER_LOOP,
    LEADER_ON_VIEW,
    NEXT_GENERATION,
    PUT_REQUEST,
    REPORT_FAILURE,
    REPORT_FAILURE_CALL,
    SCHEMA_DECODE,
    TRAIN_STEP,
    VIEW_NOTIFY,
    VIEW_RUN,
    VIEW_WAIT,
    Where,
)

ROOT = Path(__file__).resolve().parent.parent
HOOK_DIR = ROOT / "tools" / "trace_hook"

@dataclass(frozen=True)
class Frame:
    id: int
    file: str
    function: str


@dataclass(frozen=True)
class Call:
    """One recorded call (or, at a waypoint, return) into this repository's code."""

    t: int  # CLOCK_MONOTONIC, ns
    thread: int
    event: str  # "call" | "return"
    frame: int
    caller: int
    caller_function: str
    file: str
    function: str
    stack: tuple[Frame, ...] = ()  # root first; waypoints only
    generation: int | None = None
    node: str = ""
    value: str = ""  # the returned value's type, at a return

    @property
    def where(self) -> Where:
        return self.file, self.function

    @classmethod
    def of(cls, r: dict[str, Any]) -> Call:
        return cls(r["t"], r["thread"], r["event"], r["frame"], r["caller"],
                   r["caller_function"], r["file"], r["function"],
                   tuple(Frame(*f) for f in r.get("stack", ())), r.get("generation"),
                   r.get("node", ""), r.get("value", ""))


@dataclass
class Process:
    pid: int
    header: dict[str, Any]
    calls: list[Call] = field(default_factory=list)

    @property
    def agent_node(self) -> str:
        argv = self.header["argv"]
        return argv[argv.index("--node-id") + 1] if "--node-id" in argv else ""

    def points(self, where: Where, event: str = "call") -> list[Call]:
        """The waypoint records of `where` at `event`, in time order."""
        return [c for c in self.calls if c.where == where and c.event == event and c.stack]

    def first(self, where: Where, event: str = "call", after: int = 0,
              generation: int | None = None, value: str = "", node: str = "",
              within: int | None = None) -> Call:
        """The first waypoint record that matches; `within`: its stack holds that frame."""
        for c in self.points(where, event):
            if c.t >= after and (generation is None or c.generation == generation) \
                    and (not value or c.value == value) and (not node or c.node == node) \
                    and (within is None or any(f.id == within for f in c.stack)):
                return c
        raise LookupError(f"process {self.pid}: no {event} of {where[0]}:{where[1]}"
                          + (f" for generation {generation}" if generation is not None else ""))

    def last(self, where: Where, before: Call, within: int) -> Call:
        """The last call of `where` before `before` whose stack holds frame `within`: where a
        task that `before` ends was last resumed."""
        found = [c for c in self.points(where) if c.t <= before.t
                 and any(f.id == within for f in c.stack)]
        if not found:
            raise LookupError(f"process {self.pid}: no call of {where[1]} before {before.function}")
        return found[-1]


@dataclass(frozen=True)
class Segment:
    """Where one process (thread, task) carries the path: woken at `receive`, handing off at
    `handoff`."""

    process: Process
    receive: Call
    handoff: Call
    how: str  # what hands the path to the next segment

    def _common(self) -> int:
        """How many frames, from the root, `receive` and `handoff` share (matched by identity:
        those frames stayed alive between the two)."""
        r, h = self.receive.stack, self.handoff.stack
        n = 0
        while n < min(len(r), len(h)) and r[n].id == h[n].id:
            n += 1
        return n

    def main_line(self) -> list[Frame]:
        """The frames it returns through from `receive`, the one it continues in, and those it
        calls down to `handoff`."""
        n, r, h = self._common(), self.receive.stack, self.handoff.stack
        return list(reversed(r[n:])) + ([h[n - 1]] if n else []) + list(h[n:])

    def side_trips(self) -> list[Frame]:
        """Calls from the main line's frames that are alive in the window (the handoff's stack:
        the frames it returns through are gone) into other files, in the segment's window."""
        alive = {f.id: f for f in self.handoff.stack}
        # A coroutine on either stack, resumed, is a call event too, and no side trip.
        stacks = {f.id for f in self.receive.stack + self.handoff.stack}
        trips: list[Frame] = []
        for c in self.process.calls:
            if c.event != "call" or not self.receive.t < c.t < self.handoff.t:
                continue
            caller = alive.get(c.caller)
            if caller is not None and caller.function == c.caller_function \
                    and c.file != caller.file and c.frame not in stacks:
                trips.append(Frame(c.frame, c.file, c.function))
        return trips


def files_of(frames: Iterable[Frame]) -> list[tuple[str, list[str]]]:
    """Consecutive frames of one file merged: [(file, [functions])]."""
    out: list[tuple[str, list[str]]] = []
    for f in frames:
        if out and out[-1][0] == f.file:
            if f.function not in out[-1][1]:
                out[-1][1].append(f.function)
        else:
            out.append((f.file, [f.function]))
    return out


def by_file(frames: Iterable[Frame]) -> list[tuple[str, list[str]]]:
    """Frames grouped by file, files in the order first seen: [(file, [functions])]."""
    out: dict[str, list[str]] = {}
    for f in frames:
        functions = out.setdefault(f.file, [])
        if f.function not in functions:
            functions.append(f.function)
    return list(out.items())


def returns(files: list[str]) -> list[str]:
    """Files entered again after the line left them for another file."""
    seen: set[str] = set()
    again: list[str] = []
    for i, f in enumerate(files):
        if f in seen and files[i - 1] != f:
            again.append(f)
        seen.add(f)
    return again


def load(directory: Path) -> dict[int, Process]:
    processes: dict[int, Process] = {}
    for path in sorted(directory.glob("*.jsonl")):
        lines = path.read_text().splitlines()
        if not lines:
            continue
        header = json.loads(lines[0])
        proc = Process(header["process"], header)
        for raw in lines[1:]:
            try:
                proc.calls.append(Call.of(json.loads(raw)))
            except (ValueError, KeyError):
                break  # the last line of a process killed while writing it
        processes[proc.pid] = proc
    return processes


def _agent(processes: dict[int, Process], node: str) -> Process:
    return next(p for p in processes.values() if p.agent_node == node)


def _watch(agent: Process, decoded: Call, handoff: Where, how: str) -> Segment:
    """The agent's watch task: from its resumption with the batch that holds `decoded`'s record
    to the view's hand-off."""
    run = next(f for f in decoded.stack if f.function == "ClusterView.run")
    woken = agent.last(VIEW_RUN, decoded, run.id)
    out = agent.first(handoff, after=decoded.t, within=run.id)
    return Segment(agent, woken, out, how)


def generation_path(processes: dict[int, Process], node: str, generation: int) -> list[Segment]:
    """Generation `generation` reaching `node`'s worker: watch → view → GetGeneration → worker."""
    agent = _agent(processes, node)
    decoded = agent.first(SCHEMA_DECODE, "return", generation=generation, value="Plan")
    watch = _watch(agent, decoded, VIEW_NOTIFY, "the view wakes the waiting GetGeneration")
    answer = agent.first(GET_GENERATION, "return", after=watch.handoff.t,
                         generation=generation, value="GenerationPlan")
    woken = agent.last(VIEW_WAIT, answer, answer.stack[-1].id)
    worker = next(p for p in processes.values() if p.header.get("parent") == agent.pid
                  and any(c.generation == generation for c in p.points(NEXT_GENERATION, "return")))
    reply = worker.first(NEXT_GENERATION, "return", after=answer.t, generation=generation)
    step = worker.first(TRAIN_STEP, after=reply.t)
    return [watch,
            Segment(agent, woken, answer, "the answer goes to the worker over the agent's socket"),
            Segment(worker, reply, step, "")]


def failed_generation(processes: dict[int, Process], node: str, before: int) -> int:
    """The last generation before `before` in which a worker of `node` failed (its
    `Generation.run` returned). Not always `before - 1`: when the killed worker's agent sees
    the death late, the leader first plans a generation from the survivors' reports with that
    node still in it; its survivors wait at the join until the watchdog ends them, and the
    next generation is the first that trains."""
    agent = _agent(processes, node)
    failed = [c.generation for p in processes.values() if p.header.get("parent") == agent.pid
              for c in p.points(GENERATION_RUN, "return")
              if c.value == "NoneType" and c.generation is not None and c.generation < before]
    if not failed:
        raise LookupError(f"no worker of {node} failed before generation {before}")
    return max(failed)


def failure_path(processes: dict[int, Process], node: str, leader: str,
                 generation: int) -> list[Segment]:
    """A worker of `node` failing in `generation`, to the leader's decision on it."""
    agent, lead = _agent(processes, node), _agent(processes, leader)
    worker = next(p for p in processes.values() if p.header.get("parent") == agent.pid
                  and any(c.generation == generation and c.value == "NoneType"
                          for c in p.points(GENERATION_RUN, "return")))
    failed = worker.first(GENERATION_RUN, "return", generation=generation, value="NoneType")
    sent = worker.first(REPORT_FAILURE_CALL, after=failed.t)
    handled = agent.first(REPORT_FAILURE, after=sent.t, generation=generation)
    reported = agent.first(FAILURE_REPORT, after=handled.t, within=handled.stack[-1].id)
    writer = agent.first(PUT_REQUEST, after=reported.t)
    put = agent.first(ETCD_PUT, after=writer.t, within=writer.stack[-1].id)
    decoded = lead.first(SCHEMA_DECODE, "return", after=put.t, generation=generation,
                         value="ControlRequest", node=node)
    watch = _watch(lead, decoded, LEADER_ON_VIEW, "the view's listener wakes the leader's loop")
    loop = lead.first(LEADER_LOOP, after=watch.handoff.t)
    decision = lead.first(DECIDE, after=loop.t, within=loop.stack[-1].id)
    return [Segment(worker, failed, sent, "the report goes to the agent over its socket"),
            Segment(agent, handled, reported, "a task of its own puts the report in etcd"),
            Segment(agent, writer, put, "etcd's watch carries it to the leader's agent"),
            watch, Segment(lead, loop, decision, "")]


def report(title: str, segs: list[Segment]) -> tuple[str, list[str], list[str]]:
    """The path as text, its files in order, and the files it returns to."""
    lines = [title, ""]
    path: list[str] = []
    for seg in segs:
        who = "agent" if seg.process.agent_node else "worker"
        lines.append(f"  [{who} pid {seg.process.pid}, "
                     f"{(seg.handoff.t - seg.receive.t) / 1e6:.1f} ms]")
        for file, functions in files_of(seg.main_line()):
            if not path or path[-1] != file:
                path.append(file)
            lines.append(f"  {len(path):2d}. {file:40s} {', '.join(functions)}")
        trips = by_file(seg.side_trips())
        if trips:
            lines.append("      called into and back: " + "; ".join(
                f"{file} ({', '.join(functions[:3])}{', ...' if len(functions) > 3 else ''})"
                for file, functions in trips))
        if seg.how:
            lines.append(f"      -> {seg.how}")
    again = returns(path)
    lines += ["", f"files on the main line: {len(set(path))}; returns to a file already left: "
              f"{len(again)}" + (f" ({', '.join(again)})" if again else "")]
    return "\n".join(lines), path, again


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.trace_generation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="", help="default: a temporary directory")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, traces)")
    p.add_argument("--kill-step", type=int, default=4)
    p.add_argument("--json", default="", help="also write each path's files and returns here")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="trace-generation-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    traces = work / "trace"
    traces.mkdir(exist_ok=True)
    sys.path.insert(0, str(ROOT))
    os.environ["ULTRA_TRACE_DIR"] = str(traces)
    rest = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), str(HOOK_DIR), rest) if x)
    from bench.recovery import run_ultrad, write_job

    job = write_job(work)
    run = work / "run"
    run.mkdir(exist_ok=True)
    res = run_ultrad(run, job, args.kill_step, 0, "ultrad-kill-worker")
    if res.error:
        print(f"the traced run failed: {res.error}; logs in {work}", file=sys.stderr)
        return 1
    generation, leader = int(res.extra["generation"]), res.extra["leader"]
    node = next(n for n in ("node-0", "node-1", "node-2")
                if n not in (res.extra["victim"], leader))
    processes = load(traces)
    victim = res.extra["victim"]
    texts, found = [], {}
    try:
        failed = failed_generation(processes, node, generation)
        for name, title, segs in (
                ("generation", f"generation {generation} reaching {node} (a survivor that does "
                 "not lead): from the agent's watch to the worker's first step",
                 generation_path(processes, node, generation)),
                ("failure", f"{node}'s worker failing in generation {failed}: from its "
                 f"failure to the decision of the leader ({leader})",
                 failure_path(processes, node, leader, failed))):
            text, files, again = report(title, segs)
            texts.append(text)
            found[name] = {"files": files, "returns": again}
        # The same generation on the other two nodes: the leader's, and the victim's, whose
        # worker is the standby that took the killed worker's rank.
        others = []
        for other, role in ((leader, "the leader's node"),
                            (victim, "the victim's node, its standby worker")):
            _, files, again = report("", generation_path(processes, other, generation))
            found[f"generation on {role}"] = {"node": other, "files": files, "returns": again}
            others.append(f"  {other} ({role}): {len(files)} files, {len(again)} returns: "
                          + " -> ".join(files))
        texts.append(f"generation {generation} on the other nodes, the same way:\n"
                     + "\n".join(others))
    except (LookupError, StopIteration) as exc:
        print(f"could not follow a path: {exc}; traces in {traces}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))
    text = "\n\n".join(texts)
    print(text)
    if args.keep:
        print(f"\ntraces and logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
