"""The demo: train examples/tiny.toml on 4 ranks with checkpoints, resume on 3 ranks from the
middle, and print both loss trajectories side by side.

Run with `make demo-resume` (or `python -m examples.resume_demo [--steps N]`). Output goes under runs/demo/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

CONFIG = Path(__file__).with_name("tiny.toml")


def torchrun(nproc: int, ckpt_dir: Path, steps: int, every: int, resume: bool) -> dict[int, dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainer",
        "--config",
        str(CONFIG),
        "--steps",
        str(steps),
        "--log-format",
        "json",
        "--checkpoint-dir",
        str(ckpt_dir),
        "--checkpoint-every",
        str(every),
        "--set",
        "checkpoint.keep=8",
    ] + (["--resume"] if resume else [])
    print(f"$ {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    steps_seen: dict[int, dict] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            rec = json.loads(line)
            steps_seen[rec["step"]] = rec
            print(
                f"  [{nproc} ranks] step {rec['step']:3d}  loss {rec['loss']:.4f}  "
                f"{rec['tokens'] / rec['step_seconds']:8,.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    if proc.wait():
        raise SystemExit(f"training on {nproc} ranks failed (exit {proc.returncode})")
    return steps_seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    args = ap.parse_args()
    middle = args.steps // 2
    shutil.rmtree(args.out, ignore_errors=True)
    full_dir, resumed_dir = args.out / "dp4", args.out / "dp3"
    full = torchrun(4, full_dir / "checkpoints", args.steps, middle, resume=False)
    # The resumed run starts from a copy of the middle checkpoint only.
    src = full_dir / "checkpoints" / f"step_{middle:08d}"
    shutil.copytree(src, resumed_dir / "checkpoints" / src.name)
    resumed = torchrun(3, resumed_dir / "checkpoints", args.steps, middle, resume=True)

    print(
        f"\n{'step':>5} {'loss 4 ranks':>13} {'loss 3 ranks (resumed at ' + str(middle) + ')':>30} {'rel diff':>9}"
    )
    for step in sorted(full):
        a = full[step]["loss"]
        b = resumed.get(step, {}).get("loss")
        if step % 5 and step not in (1, middle + 1):
            continue
        right = f"{b:30.6f}" if b is not None else f"{'':>30}"
        diff = f"{abs(a - b) / abs(a):9.1e}" if b is not None else ""
        print(f"{step:5d} {a:13.6f} {right} {diff}")
    worst = max(abs(full[s]["loss"] - r["loss"]) / abs(full[s]["loss"]) for s, r in resumed.items())
    print(
        f"\nloss {full[1]['loss']:.3f} -> {full[args.steps]['loss']:.3f}; "
        f"resumed run matches the uninterrupted one within {worst:.1e} (relative)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
