"""Started by `python -m tools.trace_generation`, which puts this directory on PYTHONPATH: in a
process whose environment has ULTRA_TRACE_DIR, arm the call recorder (tools/call_recorder.py).
In any other process this file does nothing."""

import os

if os.environ.get("ULTRA_TRACE_DIR"):
    from tools.call_recorder import arm

    arm(os.environ["ULTRA_TRACE_DIR"])
