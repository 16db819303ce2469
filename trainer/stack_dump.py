"""A worker answers its agent's request for its Python stacks, and leaves them when it dies of a
fatal signal (docs/observability.md, "Stacks of a hung or crashed worker").

The agent opens a file of its own for each worker (0600, in its state directory) and passes it
as descriptor ULTRA_STACKS_FD. On SIGUSR1, faulthandler writes every thread's stack there from
its C signal handler: it needs no lock and no Python code to run, so a worker stuck in Python,
or in C holding the interpreter, still answers. A stopped (SIGSTOP) worker cannot. On SIGSEGV,
SIGBUS, SIGFPE, SIGILL or SIGABRT (a crash in C++: torch, gloo, NCCL) it writes them there too
("Fatal Python error: ..."), then dies of the signal as it would have; the agent reads them
when it reaps the worker. Armed on import, before `trainer.worker` imports torch.
"""

from __future__ import annotations

import faulthandler
import os
import signal


def answer_stack_requests() -> None:
    fd = os.environ.get("ULTRA_STACKS_FD", "")
    if fd:
        faulthandler.register(signal.SIGUSR1, file=int(fd), all_threads=True)
        faulthandler.enable(file=int(fd), all_threads=True)


if os.environ.get("ULTRA_STACKS_FD"):
    answer_stack_requests()
