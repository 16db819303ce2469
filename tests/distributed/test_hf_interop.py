"""Hugging Face in and out on real gloo ranks: a transformers-made Llama (llama3 RoPE scaling,
head_dim != hidden / heads) starts a job through `[init] hf` at dp 2 x tp 2 and at pp 2, whose
first loss equals `LlamaForCausalLM`'s on the same samples (fp32, 1e-5); the trained checkpoint
exported with `ultrascale-hf` loads in transformers with logits equal to ours; and import ->
export gives back the same bits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import REPO, worker_env
from tests.launch import RunResult, run_trainer

transformers = pytest.importorskip("transformers")
from examples.make_tiny_hf import make_tiny_hf  # noqa: E402

pytestmark = pytest.mark.distributed
RTOL = 1e-5
STEPS = 3


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny", seed=3)


def _job(tmp: Path, token_file: Path, hf: Path) -> Path:
    path = tmp / "job.toml"
    path.write_text(
        f'[init]\nhf = "{hf}"\n'
        f'[data]\npath = "{token_file}"\n'
        f"[train]\nsteps = {STEPS}\nglobal_batch = 8\nseq_len = 64\nseed = 11\nlr = 1e-3\n"
        "min_lr = 1e-4\nwarmup_steps = 1\n"
        "[parallel]\nmicro_batch = 2\n"
    )
    return path


def _hf_loss(hf: Path, job: Path) -> float:
    """LlamaForCausalLM's mean token loss over step 1's global batch."""
    from parallel.job import load
    from trainer.data import open_stream, step_micro_batches

    cfg = load(job)
    t = cfg.train
    stream = open_stream(cfg.data, t.seq_len, t.seed, cfg.model.vocab_size)
    batches = step_micro_batches(stream, 0, t.global_batch, 1, 0, t.global_batch, 1)
    model = transformers.LlamaForCausalLM.from_pretrained(
        hf, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        total = sum(
            F.cross_entropy(model(mb.inputs).logits.flatten(0, 1), mb.targets.flatten(),
                            reduction="sum").item()
            for mb in batches
        )
    return total / (t.global_batch * t.seq_len)


def _our_logits(ckpt: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of our model with the weights of durable checkpoint `ckpt`."""
    from checkpoint.durable import load_offline, open_offline
    from models import get_spec
    from parallel.job import from_dict

    manifest, _ = open_offline(ckpt)
    cfg = from_dict({"model": manifest.extra["model"], "data": {"source": "python-stdlib"}}).model
    spec = get_spec(cfg.family)
    model = spec.build(cfg)
    model.to_empty(device="cpu")
    spec.init_weights(model, 0)
    values = {f"state.model.{name}": p.detach() for name, p in model.named_parameters()}
    load_offline(ckpt, manifest, values)
    with torch.no_grad():
        return model(tokens)


def _hf_cli(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "trainer.hf_cli", *args], cwd=REPO,
                          env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _started_from_hf(result: RunResult, expected_loss: float) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restored pretrained weights" in result.stderr, result.stderr[-3000:]
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    assert result.steps[1]["loss"] == pytest.approx(expected_loss, rel=RTOL)


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [(4, ["parallel.dp=2", "parallel.tp=2"]), (2, ["parallel.dp=1", "parallel.pp=2"])],
    ids=["dp2xtp2", "pp2"],
)
def test_start_train_export(tmp_path: Path, token_file: Path, hf_model: Path, nproc: int,
                            layout: list[str]) -> None:
    job = _job(tmp_path, token_file, hf_model)
    ckpt = tmp_path / "ckpt"
    sets = [x for item in layout for x in ("--set", item)]
    result = run_trainer(job, nproc, "--checkpoint-dir", str(ckpt), *sets)
    _started_from_hf(result, _hf_loss(hf_model, job))

    out = tmp_path / "export"
    _hf_cli("export", str(ckpt), str(out))
    assert {p.name for p in out.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors"}
    exported = transformers.LlamaForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    assert exported.config.rope_parameters["rope_type"] == "llama3"
    assert exported.config.head_dim == 32
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = exported(tokens).logits
    ours = _our_logits(ckpt / f"step_{STEPS:08d}", tokens)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=RTOL)
    # Training moved the weights: the export is not the starting model.
    start = transformers.LlamaForCausalLM.from_pretrained(hf_model, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(start(tokens).logits, theirs, rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_import_then_export_is_bit_exact(tmp_path: Path, dtype: str) -> None:
    from safetensors.torch import load_file

    src = make_tiny_hf(tmp_path / "src", dtype=dtype, seed=4)
    _hf_cli("import", str(src), str(tmp_path / "ckpt"))
    # A shard limit below the model's size: the export is split and indexed.
    _hf_cli("export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--dtype", dtype,
            "--max-shard-bytes", "400000")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    theirs = load_file(src / "model.safetensors")
    ours: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        ours |= load_file(tmp_path / "out" / name)
    assert len(set(index["weight_map"].values())) > 1
    assert ours.keys() == theirs.keys() == index["weight_map"].keys()
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype, name
        assert ours[name].view(torch.uint8).equal(value.view(torch.uint8)), name
