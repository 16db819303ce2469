"""tools/trace_generation.py's reading of a trace, and tools/call_recorder.py's records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.call_recorder import Recorder
from tools.trace_generation import Call, Frame, Process, Segment, by_file, load, returns

HERE = "tests/unit/test_trace_generation.py"


def call(t: int, file: str, function: str, frame: int, caller: int = 0,
         caller_function: str = "", stack: tuple[Frame, ...] = (), event: str = "call",
         **kw: object) -> Call:
    return Call(t, 1, event, frame, caller, caller_function, file, function, stack, **kw)


LOOP = Frame(10, "w.py", "main")
ASK = Frame(11, "link.py", "ask")
RUN = Frame(12, "gen.py", "run")
STEP = Frame(13, "loop.py", "step")


def test_the_main_line_returns_through_the_receiver_and_calls_down_to_the_handoff() -> None:
    seg = Segment(Process(1, {}), call(1, "link.py", "ask", 11, stack=(LOOP, ASK)),
                  call(9, "loop.py", "step", 13, stack=(LOOP, RUN, STEP)), "")
    assert [f.file for f in seg.main_line()] == ["link.py", "w.py", "gen.py", "loop.py"]


def test_a_segment_with_no_common_frame_is_its_receiver_then_its_handoff() -> None:
    seg = Segment(Process(1, {}), call(1, "a.py", "f", 1, stack=(Frame(1, "a.py", "f"),)),
                  call(2, "b.py", "g", 2, stack=(Frame(2, "b.py", "g"),)), "")
    assert [f.file for f in seg.main_line()] == ["a.py", "b.py"]


def test_side_trips_come_from_live_main_line_frames_inside_the_window() -> None:
    receive = call(10, "link.py", "ask", 11, event="return", stack=(LOOP, ASK))
    handoff = call(50, "loop.py", "step", 13, stack=(LOOP, RUN, STEP))
    proc = Process(1, {}, [
        call(5, "spec.py", "of", 20, caller=12, caller_function="run"),  # before the window
        call(20, "world.py", "build", 21, caller=12, caller_function="run"),  # a side trip
        call(21, "gen.py", "helper", 22, caller=12, caller_function="run"),  # same file
        call(22, "x.py", "f", 23, caller=11, caller_function="ask"),  # ASK returned: not alive
        call(23, "y.py", "g", 24, caller=12, caller_function="other"),  # id reused by another
        call(24, "deep.py", "h", 25, caller=21, caller_function="build"),  # not main line
        call(30, "gen.py", "run", 12, caller=10, caller_function="main"),  # main line itself
        call(60, "late.py", "z", 26, caller=12, caller_function="run"),  # after the handoff
    ])
    seg = Segment(proc, receive, handoff, "")
    assert [(f.file, f.function) for f in seg.side_trips()] == [("world.py", "build")]


def test_a_resumed_coroutine_above_the_line_is_no_side_trip() -> None:
    # Alive on both stacks, above the frame where the line turns (LOOP): resuming the task
    # resumes them too, each a call event from the one above it.
    root, outer = Frame(8, "boot.py", "start"), Frame(9, "outer.py", "serve")
    receive = call(10, "link.py", "ask", 11, event="return", stack=(root, outer, LOOP, ASK))
    handoff = call(50, "loop.py", "step", 13, stack=(root, outer, LOOP, RUN, STEP))
    proc = Process(1, {}, [
        call(20, "outer.py", "serve", 9, caller=8, caller_function="start"),  # resumed
        call(21, "util.py", "helper", 30, caller=8, caller_function="start"),  # a real trip
    ])
    seg = Segment(proc, receive, handoff, "")
    assert [f.file for f in seg.main_line()] == ["link.py", "w.py", "gen.py", "loop.py"]
    assert [f.file for f in seg.side_trips()] == ["util.py"]


def test_returns_are_files_entered_again_after_another() -> None:
    assert returns(["a", "b", "c"]) == []
    assert returns(["a", "a", "b"]) == []
    assert returns(["a", "b", "a", "c", "b"]) == ["a", "b"]


def test_by_file_groups_in_first_seen_order() -> None:
    frames = [Frame(1, "a", "f"), Frame(2, "b", "g"), Frame(3, "a", "h"), Frame(4, "a", "f")]
    assert by_file(frames) == [("a", ["f", "h"]), ("b", ["g"])]


def test_first_and_last_match_waypoints_by_generation_value_node_and_frame() -> None:
    where = ("s.py", "decode")
    stack = (Frame(7, "v.py", "run"), Frame(8, "s.py", "decode"))
    proc = Process(1, {}, [
        call(1, *where, 8, event="return", stack=stack, generation=1, value="Plan"),
        call(2, *where, 8, event="return", stack=stack, generation=2, value="Control",
             node="n1"),
        call(3, *where, 8, event="return", stack=stack, generation=2, value="Plan"),
        call(4, *where, 8, event="return", generation=2, value="Plan"),  # no stack: no waypoint
    ])
    assert proc.first(where, "return", generation=2, value="Plan").t == 3
    assert proc.first(where, "return", generation=2, node="n1").t == 2
    assert proc.first(where, "return", after=2, within=7).t == 2
    resumed = Process(1, {}, [call(t, "v.py", "run", 7, stack=stack[:1]) for t in (1, 5, 9)])
    assert resumed.last(("v.py", "run"), proc.calls[2], 7).t == 1
    try:
        proc.first(where, "return", generation=3)
    except LookupError as exc:
        assert "generation 3" in str(exc)
    else:
        raise AssertionError("found a generation that is not there")


def _waypoint(generation: int) -> object:
    class Answer:
        def __init__(self, g: int) -> None:
            self.generation, self.node = g, "node-1"
    return Answer(generation)


def _caller() -> object:
    return _waypoint(5)


def test_the_recorder_writes_calls_and_the_stack_at_a_waypoint(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, {(HERE, "_waypoint"): "return"})
    sys.setprofile(rec.profile)
    try:
        _caller()
    finally:
        rec.close()
    processes = load(tmp_path)
    [proc] = processes.values()
    names = [(c.function, c.event) for c in proc.calls]
    assert ("_caller", "call") in names and ("_waypoint", "call") in names
    [point] = proc.points((HERE, "_waypoint"), "return")
    assert (point.generation, point.node, point.value) == (5, "node-1", "Answer")
    assert [f.function for f in point.stack][-2:] == ["_caller", "_waypoint"]
    assert all(f.file == HERE for f in point.stack)  # pytest's own frames are not this repo's
    inner = next(c for c in proc.calls if c.function == "_waypoint" and c.event == "call")
    assert inner.caller_function == "_caller"
    header = json.loads((tmp_path / f"{proc.pid}.jsonl").read_text().splitlines()[0])
    assert header["process"] == proc.pid
