"""The nccl/CUDA path against the CPU reference: `python -m bench.gpu_parity` (needs a GPU).

Runs the real trainer (a world of one: FSDP2 on an nccl group, SDPA/flash attention on the
GPU) on a small synthetic job and compares its per-step fp32 losses with the single-process
CPU reference on the same data; then a bf16 run of the same job against the fp32 losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from parallel.job import load
from parallel.layout import Layout
from trainer.loop import Trainer
from trainer.tokens import write_token_file

JOB = """[model]
hidden_size = 256
intermediate_size = 688
num_hidden_layers = 4
num_attention_heads = 8
num_key_value_heads = 4
vocab_size = 256
max_position_embeddings = 256
[data]
path = "{data}"
[train]
steps = 10
global_batch = 12
seq_len = 256
lr = 3e-3
[parallel]
micro_batch = 4
"""


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU: nothing to compare", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "walk.bin"
        rng = np.random.default_rng(0)
        write_token_file(
            data,
            (np.cumsum(rng.integers(-2, 3, 300_000)) % 64 + 32),
            vocab_size=256,
            source="random walk",
            tokenizer="bytes",
        )
        job = Path(tmp) / "job.toml"
        job.write_text(JOB.format(data=data))
        cfg = load(job)
        ref = Trainer(cfg, Layout(dp=1, micro_batch=4, grad_accum=3), None, torch.device("cpu"))
        ref_losses = [ref.train_step().loss for _ in range(cfg.train.steps)]
        runs = {}
        for precision in ("fp32", "bf16"):
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "trainer",
                    "--config",
                    str(job),
                    "--log-format",
                    "json",
                    "--set",
                    f'parallel.mixed_precision="{precision}"',
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs[precision] = [
                json.loads(x)["loss"] for x in proc.stdout.splitlines() if x.startswith("{")
            ]
    print(f"{'step':>4} {'cpu fp32':>10} {'gpu fp32':>10} {'rel':>8} {'gpu bf16':>10} {'rel':>8}")
    for i, ref_loss in enumerate(ref_losses):
        a, b = runs["fp32"][i], runs["bf16"][i]
        print(
            f"{i + 1:4d} {ref_loss:10.6f} {a:10.6f} {abs(a - ref_loss) / ref_loss:8.1e} {b:10.6f} "
            f"{abs(b - ref_loss) / ref_loss:8.1e}"
        )
    worst32 = max(abs(a - r) / r for a, r in zip(runs["fp32"], ref_losses, strict=True))
    worst16 = max(abs(b - r) / r for b, r in zip(runs["bf16"], ref_losses, strict=True))
    print(
        f"max relative difference: gpu fp32 {worst32:.1e}, gpu bf16 {worst16:.1e} ({torch.cuda.get_device_name()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
