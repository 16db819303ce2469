"""`[init] hf` of a transformers-made Qwen2-MoE (gated shared expert, dense first layer, q/k/v
biases) at ep 2 under ZeRO-3, on real gloo ranks: each rank reads only its own experts' file
tensors into its shard, and the first step's loss equals `Qwen2MoeForCausalLM`'s cross-entropy
on the same samples (fp32, 1e-5; the balancing loss is off, so the loss is the cross-entropy)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.launch import run_trainer

transformers = pytest.importorskip("transformers")
from examples.make_tiny_hf import make_tiny_hf  # noqa: E402

pytestmark = pytest.mark.distributed


def _hf_loss(hf: Path, job: Path) -> float:
    """Qwen2MoeForCausalLM's mean token loss over step 1's global batch."""
    from parallel.job import load
    from trainer.data import open_stream, step_micro_batches

    cfg = load(job)
    t = cfg.train
    stream = open_stream(cfg.data, t.seq_len, t.seed, cfg.model.vocab_size)
    batches = step_micro_batches(stream, 0, t.global_batch, 1, 0, t.global_batch, 1)
    model = transformers.Qwen2MoeForCausalLM.from_pretrained(
        hf, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        total = sum(F.cross_entropy(model(mb.inputs).logits.flatten(0, 1), mb.targets.flatten(),
                                    reduction="sum").item() for mb in batches)
    return total / (t.global_batch * t.seq_len)


def test_init_hf_at_ep2_reads_each_ranks_experts(tmp_path: Path, token_file: Path) -> None:
    hf = make_tiny_hf(tmp_path / "hf", model_type="qwen2_moe", seed=5)
    job = tmp_path / "job.toml"
    # No family: model_type qwen2_moe makes it "moe".
    job.write_text(
        f'[init]\nhf = "{hf}"\n[model]\nrouter_aux_loss_coef = 0.0\n'
        f'[data]\npath = "{token_file}"\n'
        "[train]\nsteps = 1\nglobal_batch = 4\nseq_len = 32\nseed = 11\nlr = 1e-3\n"
        "min_lr = 1e-4\nwarmup_steps = 1\n"
        "[parallel]\nmicro_batch = 2\nep = 2\nzero = 3\n"
    )
    result = run_trainer(job, 2, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restored pretrained weights" in result.stderr, result.stderr[-3000:]
    assert re.search(r"'dp': 2, .*'ep': 2, 'zero': 3", result.stderr), result.stderr[-3000:]
    assert result.steps[1]["loss"] == pytest.approx(_hf_loss(hf, job), rel=1e-5)
