"""How busy the whole machine's CPUs were over a window: /proc/stat, sampled by a thread.

A recovery on this machine runs every process of three "nodes" on its few cores. When the
cores are busy for the whole of a recovery, its wall time is the CPU work of all of them over
the cores there are, and a node with cores of its own per rank would finish it sooner:
`bench.recovery` prints the mean number of busy cores from the kill to the first step.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuTimes:
    """The machine's CPU seconds so far, over all its CPUs: `busy` (user, nice, system, irq,
    softirq), `steal` (time the hypervisor gave to others while a CPU here wanted it)."""

    busy: float
    steal: float

    @classmethod
    def parse(cls, stat: str) -> CpuTimes:
        """From /proc/stat's text: its first line, `cpu` and the ticks of every state."""
        first = stat.split("\n", 1)[0].split()
        if not first or first[0] != "cpu" or len(first) < 9:
            raise ValueError(f"/proc/stat: its first line is not the CPUs' total: {first[:3]}")
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, first[1:9])
        return cls((user + nice + system + irq + softirq) * TICK_S, steal * TICK_S)


@dataclass
class CpuBusy:
    """Samples `CpuTimes` every `interval` seconds between `start` and `stop`."""

    interval: float = 0.01  # the kernel counts in ticks of 10 ms (USER_HZ 100)
    source: Path = Path("/proc/stat")
    samples: list[tuple[float, CpuTimes]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> CpuBusy:
        self._thread = threading.Thread(target=self._run, name="cpu-busy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (again: nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), CpuTimes.parse(self.source.read_text())))
            self._stop.wait(self.interval)

    def between(self, t0: float, t1: float) -> tuple[float, float] | None:
        """(busy cores, stolen cores) on average from the last sample at or before `t0` to the
        first at or after `t1`; None when the samples do not cover the window."""
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after or after[0][0] <= before[-1][0]:
            return None
        (a, x), (b, y) = before[-1], after[0]
        return (y.busy - x.busy) / (b - a), (y.steal - x.steal) / (b - a)
