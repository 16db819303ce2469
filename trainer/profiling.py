"""`[profile] steps = [first, last]`: a torch.profiler trace of those steps on chosen ranks.

The profiler starts just before step `first` and stops just after step `last`; between two
steps of the window its collection is switched off, so what runs between steps (agreement,
snapshots, checkpoints) is not in the trace. Each step is a `train_step#<n>` annotation
(`record_function`), so a reader can see where each step begins and ends. The trace is a Chrome
trace (`chrome://tracing`, Perfetto) named `*.pt.trace.json`, which TensorBoard's profiler
plugin also reads: `<output_dir>/profile/rank_<global rank>/steps_<first>-<last>.pt.trace.json`.
A window run again (a generation that restored to before it) replaces the file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from parallel.job import ProfileConfig


def profiles_rank(cfg: ProfileConfig, rank: int) -> bool:
    return bool(cfg.steps) and (cfg.ranks == "all" or rank in cfg.ranks)


def trace_path(directory: Path, rank: int, first: int, last: int) -> Path:
    return directory / "profile" / f"rank_{rank}" / f"steps_{first}-{last}.pt.trace.json"


class StepProfiler:
    """Wraps each step (`with profiler.step(n)`); records only inside the configured window."""

    def __init__(self, cfg: ProfileConfig, rank: int, directory: Path,
                 device: torch.device) -> None:
        self.enabled = profiles_rank(cfg, rank)
        self.first, self.last = cfg.steps if self.enabled else (0, 0)
        self.path = trace_path(directory, rank, self.first, self.last)
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._prof: profile | None = None

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Around step `number` (1-based: the step about to run)."""
        if not self.enabled or not self.first <= number <= self.last:
            self.close()  # a window left early (the run restored to before it) is dropped
            yield
            return
        if self._prof is None:
            if number != self.first:  # joined mid-window: a partial trace would mislead
                yield
                return
            self._prof = profile(activities=self.activities)
            self._prof.start()
        else:
            self._prof.toggle_collection_dynamic(True, self.activities)
        try:
            with record_function(f"train_step#{number}"):
                yield
        except BaseException:
            self.close()
            raise
        if number == self.last:
            self._export()
        else:
            self._prof.toggle_collection_dynamic(False, self.activities)

    def _export(self) -> None:
        prof, self._prof = self._prof, None
        assert prof is not None
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + f".{os.getpid()}.partial")
        prof.export_chrome_trace(str(partial))
        os.replace(partial, self.path)  # a reader never sees half a trace

    def close(self) -> None:
        """Stop a window still open (the generation ended inside it), writing nothing."""
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()
