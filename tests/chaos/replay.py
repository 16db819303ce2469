"""Replay a daemon run's layout history with the torchrun entry and compare losses.

From steps.jsonl: the committed line of each step is its last one; consecutive committed steps
of one generation form a segment (world size, dp, tp, pp, cp, first step, last step), and
consecutive segments of the same layout form one run (`torchrun_runs`: an uninterrupted run is
what the daemon's history must equal). The replay runs one `python -m torch.distributed.run
--standalone --nproc-per-node=<world> -m trainer --config JOB --set parallel.tp=<tp> --set
parallel.pp=<pp> --set parallel.cp=<cp> --checkpoint-dir DIR --resume --steps <last>
--log-format json` per run, in order, in one checkpoint directory (a generation the daemon
re-planned changes tp, pp or cp): `--steps S` always checkpoints step S (trainer/driver.py), so
the next run resumes from exactly the step the daemon's generation restored.

Replays are cached by (job, run prefix): the checkpoint directory after each prefix and the
losses so far, so scenarios that share a history prefix (most start with the same 3-rank
segment) pay for it once per session (or once ever, with ULTRA_CHAOS_REPLAY_CACHE set).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import REPO, worker_env

REPLAY_TIMEOUT_S = 600


@dataclass(frozen=True)
class Segment:
    generation: int
    world_size: int
    dp: int
    first: int
    last: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1


@dataclass
class ReplayResult:
    losses: dict[int, float] = field(default_factory=dict)
    dp: dict[int, int] = field(default_factory=dict)
    cached_segments: int = 0
    run_segments: int = 0


@dataclass
class Diff:
    max_rel: float = 0.0
    mismatches: list[str] = field(default_factory=list)


def segments(lines: list[dict[str, Any]]) -> list[Segment]:
    last: dict[int, dict[str, Any]] = {}
    for line in lines:
        last[line["step"]] = line
    out: list[Segment] = []
    for step in sorted(last):
        line = last[step]
        cur = out[-1] if out else None
        if cur is not None and cur.generation == line["generation"] and cur.last == step - 1:
            out[-1] = dataclasses.replace(cur, last=step)
        else:
            out.append(Segment(line["generation"], line["world_size"], line["dp"], step, step,
                               line["tp"], line["pp"], line["cp"], line.get("ep", 1)))
    return out


def torchrun_runs(segs: list[Segment]) -> list[Segment]:
    """The torchrun invocations that replay `segs`: consecutive segments of the same layout
    (a generation that replaced a worker or a node at the same size) are one run, since an
    uninterrupted run is what the daemon's history must equal; each run is one process start
    and one checkpoint round trip fewer (about 6 s here for a 3-rank segment)."""
    out: list[Segment] = []
    for seg in segs:
        prev = out[-1] if out else None
        if prev is not None and seg.first == prev.last + 1 and _layout(prev) == _layout(seg):
            out[-1] = dataclasses.replace(prev, last=seg.last)
        else:
            out.append(seg)
    return out


def _layout(s: Segment) -> tuple[int, ...]:
    return (s.world_size, s.dp, s.tp, s.pp, s.cp, s.ep)


def _key(job_text: str, segs: list[Segment]) -> str:
    h = hashlib.sha256(job_text.encode())
    h.update(json.dumps([(s.world_size, s.tp, s.pp, s.cp, s.ep, s.first, s.last)
                         for s in segs]).encode())
    return h.hexdigest()[:20]


def replay(job_text: str, segs: list[Segment], cache: Path) -> ReplayResult:
    """Losses of the torchrun replay of `segs` (see the module docstring)."""
    segs = torchrun_runs(segs)
    cache.mkdir(parents=True, exist_ok=True)
    result = ReplayResult()
    start = 0
    for i in reversed(range(len(segs))):
        done = cache / _key(job_text, segs[: i + 1]) / "done.json"
        if done.exists():
            saved = json.loads(done.read_text())
            result.losses = {int(k): v for k, v in saved["losses"].items()}
            result.dp = {int(k): v for k, v in saved["dp"].items()}
            start = result.cached_segments = i + 1
            break
    if start == len(segs):
        return result
    work = cache / f"work-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    job = work / "job.toml"
    job.write_text(job_text)
    ckpt = work / "ckpt"
    if start:
        shutil.copytree(cache / _key(job_text, segs[:start]) / "ckpt", ckpt)
    try:
        for i in range(start, len(segs)):
            seg = segs[i]
            if i > 0 and seg.first != segs[i - 1].last + 1:
                raise AssertionError(f"segments not contiguous: {segs}")
            args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={seg.world_size}", "-m", "trainer", "--config", str(job),
                    "--set", f"parallel.tp={seg.tp}", "--set", f"parallel.pp={seg.pp}",
                    "--set", f"parallel.cp={seg.cp}", "--set", f"parallel.ep={seg.ep}",
                    "--checkpoint-dir", str(ckpt), "--resume", "--steps", str(seg.last),
                    "--log-format", "json"]
            proc = subprocess.run(args, capture_output=True, text=True, cwd=work,
                                  env={**worker_env(), "PYTHONPATH": str(REPO)},
                                  timeout=REPLAY_TIMEOUT_S)
            (work / f"segment-{i}.log").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
            if proc.returncode != 0:
                raise AssertionError(f"replay of {seg} failed ({proc.returncode}):\n"
                                     f"{proc.stderr[-3000:]}")
            ran = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
            steps = [r["step"] for r in ran]
            if steps != list(range(seg.first, seg.last + 1)):
                raise AssertionError(f"replay of {seg} ran steps {steps} (resumed from the wrong "
                                     f"checkpoint?)\n{proc.stderr[-3000:]}")
            for r in ran:
                result.losses[r["step"]] = r["loss"]
                result.dp[r["step"]] = r["dp"]
            result.run_segments += 1
            entry = cache / _key(job_text, segs[: i + 1])
            tmp = cache / f"tmp-{uuid.uuid4().hex[:8]}"
            shutil.copytree(ckpt, tmp / "ckpt")
            (tmp / "done.json").write_text(json.dumps(
                {"segments": [s.__dict__ for s in segs[: i + 1]],
                 "losses": result.losses, "dp": result.dp}))
            if entry.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, entry)
    finally:
        if os.environ.get("ULTRA_CHAOS_KEEP_REPLAYS") != "1":
            shutil.rmtree(work, ignore_errors=True)
    return result


def compare(committed: dict[int, dict[str, Any]], result: ReplayResult,
            rtol: float = 1e-6) -> Diff:
    d = Diff()
    for step, line in sorted(committed.items()):
        ref = result.losses.get(step)
        if ref is None:
            d.mismatches.append(f"step {step}: not in the replay")
            continue
        rel = abs(line["loss"] - ref) / max(abs(ref), 1e-30)
        d.max_rel = max(d.max_rel, rel)
        if rel > rtol:
            d.mismatches.append(f"step {step}: loss {line['loss']!r} vs replay {ref!r} (rel "
                                f"{rel:.2e}; generation {line['generation']}, dp {line['dp']})")
        if result.dp.get(step) != line["dp"]:
            d.mismatches.append(f"step {step}: dp {line['dp']} vs replay dp "
                                f"{result.dp.get(step)}")
    return d
