"""The start method of the distributed tests' rank processes: one server imports torch and the
trainer once, and forks every rank from there.

With "spawn" each rank imports torch and the trainer itself (about 3 s of CPU each); these tests
start a hundred ranks. A forkserver is a fresh single-threaded process that has run no torch code,
so forking from it is as safe as spawning. Its ranks inherit the server's environment from when it
started (the session's first use), not the test's: pass a rank anything it needs as an argument.
"""

from __future__ import annotations

import multiprocessing

PRELOAD = ["torch", "torch.distributed", "trainer.run", "tests.forkrun"]


def forkserver() -> str:
    """"forkserver" for `torch.multiprocessing.start_processes`, its server preloading PRELOAD
    (taken when the server starts, at the first use)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"
