"""Model FLOPs utilisation of the trainer on one accelerator (or CPU, for a smoke run).

`python -m bench.mfu [--size 350m|1b|tiny] [--steps N] [--precision bf16|fp32] [--profile]` launches
the real trainer (`torchrun --nproc-per-node 1 -m trainer`) on a synthetic token file and reports the
median step time, tokens/s and MFU = achieved model FLOP/s / peak FLOP/s. Model FLOPs per token
follow the playbook ("Memory usage in Transformers" / compute): 6·N for the dense weights plus
12·L·h·s for attention scores and values (forward + backward), N excluding the embedding.

`--profile` also traces steps 4 and 5 (`[profile]`, left out of the step time) and prints where
they went: the fraction of the step the GPU was busy, the kernels that took the most of it, and
the CUDA runtime calls the host spent the most time in (synchronizations show up there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from trainer.tokens import write_token_file

SIZES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, seq, global_batch, micro_batch)
    "tiny": (128, 384, 8, 8, 4, 128, 16, 4),
    "350m": (1024, 2816, 24, 16, 8, 2048, 16, 4),
    "1b": (2048, 5632, 22, 32, 4, 2048, 16, 2),
}
VOCAB = 32000
# Dense bf16 / fp32 peaks (vendor figures) per device name fragment.
PEAKS = {"H200": (989e12, 67e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12)}


def model_flops_per_token(
    hidden: int, inter: int, layers: int, heads: int, kv: int, seq: int
) -> float:
    head_dim = hidden // heads
    per_layer = hidden * (heads * head_dim) * 2 + hidden * (kv * head_dim) * 2 + 3 * hidden * inter
    n = layers * per_layer + hidden * VOCAB  # blocks + LM head (embedding lookups are free)
    return 6 * n + 12 * layers * hidden * seq


def job_text(size: str, data: Path, steps: int, precision: str) -> str:
    h, i, layers, heads, kv, seq, gb, mb = SIZES[size]
    return f"""[model]
hidden_size = {h}
intermediate_size = {i}
num_hidden_layers = {layers}
num_attention_heads = {heads}
num_key_value_heads = {kv}
vocab_size = {VOCAB}
max_position_embeddings = {seq}
[data]
path = "{data}"
[train]
steps = {steps}
global_batch = {gb}
seq_len = {seq}
warmup_steps = 2
[parallel]
micro_batch = {mb}
mixed_precision = "{precision}"
"""


def summarize_trace(path: Path, top: int = 12) -> str:
    """Where the traced steps went, from a torch.profiler Chrome trace."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if str(e.get("name", "")).startswith("train_step#")]
    wall = sum(float(e["dur"]) for e in steps) or float("nan")

    def total(category: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in events:
            if e.get("cat") == category:
                out[e["name"]] = out.get(e["name"], 0.0) + float(e["dur"])
        return out

    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                   for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    lines = [f"traced {len(steps)} steps: {wall / 1e3 / max(len(steps), 1):.1f} ms each, GPU "
             f"busy {busy / wall:.0%} of them"]
    for title, table in (("kernels", total("kernel")), ("CUDA runtime", total("cuda_runtime"))):
        lines.append(f"{title} (ms per step, share of the step):")
        for name, dur in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {dur / 1e3 / max(len(steps), 1):8.2f} {dur / wall:6.1%}  {name[:90]}")
    return "\n".join(lines)


def peak_flops(precision: str) -> tuple[float, str]:
    import torch

    if not torch.cuda.is_available():
        return float("nan"), "cpu"
    name = torch.cuda.get_device_name()
    for key, (bf16, fp32) in PEAKS.items():
        if key in name:
            return (bf16 if precision == "bf16" else fp32), name
    return float("nan"), name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=SIZES, default="tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--profile", action="store_true", help="trace steps 4-5 and summarize them")
    args = ap.parse_args()
    traced = (4, 5) if args.profile else ()
    h, i, layers, heads, kv, seq, gb, _ = SIZES[args.size]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        rng = np.random.default_rng(0)
        write_token_file(
            data,
            rng.integers(0, VOCAB, size=4_000_000),
            vocab_size=VOCAB,
            source="random",
            tokenizer="none",
        )
        job = Path(tmp) / "job.toml"
        text = job_text(args.size, data, args.steps, args.precision)
        if traced:
            text += f'[job]\noutput_dir = "{tmp}/out"\n[profile]\nsteps = {list(traced)}\n'
        job.write_text(text)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "-m",
            "trainer",
            "--config",
            str(job),
            "--log-format",
            "json",
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "8"}
        )
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        summary = "\n".join(summarize_trace(p) for p in
                            sorted((Path(tmp) / "out" / "profile").rglob("*.json"))) \
            if traced else ""
    # Warm-up steps and traced ones (the profiler slows them) left out.
    times = [r["step_seconds"] for r in records[2:] if r["step"] not in traced]
    step = statistics.median(times)
    tokens = gb * seq
    flops = model_flops_per_token(h, i, layers, heads, kv, seq) * tokens / step
    peak, device = peak_flops(args.precision)
    print(
        f"{'size':>6} {'precision':>9} {'device':>22} {'step s':>8} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6}"
    )
    print(
        f"{args.size:>6} {args.precision:>9} {device[:22]:>22} {step:8.3f} {tokens / step:10,.0f} "
        f"{flops / 1e12:8.1f} {flops / peak:6.1%}"
    )
    print(f"losses: {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    if summary:
        print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
