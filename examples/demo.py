"""The demo: three simulated nodes train examples/tiny.toml under ultrad; one is killed mid-run.

`make demo` (or `python -m examples.demo [--steps N] [--kill-at S]`) starts a local etcd and
three agents (one CPU worker each), submits the job, kills -9 one agent at step S, and shows
the survivors re-forming the mesh, restoring the newest in-memory snapshot (the dead node's
shard from its buddy's memory) and finishing. It then prints the committed loss curve with the
generation and world size of every step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path

from daemon.cli.local import LocalCluster, _call
from parallel.job import load
from proto.ultrascale.v1 import agent_pb2 as pb

CONFIG = Path(__file__).with_name("tiny.toml")


def steps_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--state-dir", type=Path, default=Path("runs/demo-cluster"))
    args = ap.parse_args()
    shutil.rmtree(args.state_dir, ignore_errors=True)
    output = (args.state_dir / "output").resolve()
    overrides = [f"train.steps={args.steps}", "checkpoint.every=10", f'job.output_dir="{output}"']
    load(CONFIG, overrides)  # fail fast, naming the field, on a bad override
    cluster = LocalCluster(args.state_dir.resolve(), nodes=3, devices_per_node=1, ttl=3)
    steps_file = output / "steps.jsonl"
    try:
        cluster.start()
        token = cluster.token_file.read_text().strip()
        _call(
            cluster,
            token,
            "SubmitJob",
            pb.SubmitJobRequest(spec_toml=CONFIG.read_text(), overrides=overrides),
        )
        print(f"3 agents up (etcd {cluster.etcd.endpoint}); job submitted", flush=True)
        shown, killed_at, recovered = 0, 0.0, False
        while True:
            for rec in steps_of(steps_file)[shown:]:
                shown += 1
                print(
                    f"  step {rec['step']:3d}  loss {rec['loss']:.4f}  generation {rec['generation']}  "
                    f"world {rec['world_size']}",
                    flush=True,
                )
                if killed_at and not recovered and rec["world_size"] == 2:
                    print(
                        f"  -> first step of the new generation {time.time() - killed_at:.1f} s after the kill "
                        f"(its own step time included)",
                        flush=True,
                    )
                    recovered = True
                if rec["step"] >= args.kill_at and not killed_at:
                    victim = cluster.agents["node-2"]
                    victim.send_signal(signal.SIGKILL)
                    killed_at = time.time()
                    print(
                        f"  -> kill -9 node-2 (agent pid {victim.pid}) after step {rec['step']}",
                        flush=True,
                    )
            status = _call(cluster, token, "GetStatus", pb.GetStatusRequest())
            if status.finished:
                break
            time.sleep(0.2)
    finally:
        cluster.stop()

    committed: dict[int, dict] = {}
    reruns = 0
    for rec in steps_of(steps_file):
        reruns += rec["step"] in committed
        committed[rec["step"]] = rec
    print(f"\n{'step':>5} {'loss':>8} {'gen':>4} {'world':>6}")
    for step in sorted(committed):
        if step % 5 == 0 or step == 1:
            r = committed[step]
            print(f"{step:5d} {r['loss']:8.4f} {r['generation']:4d} {r['world_size']:6d}")
    first, last = committed[min(committed)], committed[max(committed)]
    print(
        f"\nloss {first['loss']:.3f} -> {last['loss']:.3f}; {len(committed)} steps committed, "
        f"{reruns} re-run after the restore; output in {output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
