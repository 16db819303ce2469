"""Our Llama against transformers' `LlamaForCausalLM` on the same weights, and `[init] hf`'s
config handling: logits equal (fp32, 1e-5) for each rope type, head_dim != hidden / heads,
biases and tied embeddings; config.json fields become `[model]`, contradictions are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models import get_spec
from models.llama import config as llama_config
from parallel.job import ConfigError, ModelConfig, loads
from trainer.pretrained import PretrainedInvalid, load_pretrained

transformers = pytest.importorskip("transformers")
from examples.make_tiny_hf import make_tiny_hf  # noqa: E402

pytestmark = pytest.mark.unit

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def _ours(directory: Path) -> torch.nn.Module:
    fields = get_spec("llama").hf.config_from_hf(json.loads((directory / "config.json").read_text()))
    cfg = loads(f'[data]\nsource = "python-stdlib"\n[init]\nhf = "{directory}"\n').model
    assert cfg == loads("[data]\nsource = \"python-stdlib\"\n", [
        f"model.{k}={json.dumps(v) if not isinstance(v, dict) else _inline(v)}"
        for k, v in fields.items()]).model
    model = get_spec("llama").build(cfg)
    model.to_empty(device="cpu")
    get_spec("llama").init_weights(model, 0)
    load_pretrained(model, directory)
    return model


def _inline(d: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + "}"


def _theirs(directory: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_scaling": ROPES["default"]},
        {"rope_scaling": ROPES["linear"]},
        {"rope_scaling": ROPES["llama3"]},
        {"rope_scaling": ROPES["llama3"], "head_dim": 16, "attention_bias": True,
         "mlp_bias": True},
        {"rope_scaling": None, "tie_word_embeddings": True, "head_dim": 48},
    ],
    ids=["default-hd32", "linear-hd32", "llama3-hd32", "llama3-biases", "tied-hd48"],
)
def test_logits_equal_transformers(tmp_path: Path, overrides: dict) -> None:
    directory = make_tiny_hf(tmp_path / "hf", **overrides)
    ours, theirs = _ours(directory), _theirs(directory)
    tokens = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_files_load_exactly(tmp_path: Path) -> None:
    directory = make_tiny_hf(tmp_path / "hf", dtype="bf16")
    model = _ours(directory)
    from safetensors.torch import load_file

    stored = load_file(directory / "model.safetensors")
    for name, p in model.named_parameters():
        want = stored[llama_config.to_hf(name)]
        assert p.dtype == torch.float32 and torch.equal(p, want.float()), name


def test_model_fields_come_from_config_json(tmp_path: Path) -> None:
    directory = make_tiny_hf(tmp_path / "hf")
    cfg = loads(f'[data]\nsource = "python-stdlib"\n[init]\nhf = "{directory}"\n'
                "[model]\nhidden_size = 64\n")
    assert cfg.model.head_dim == 32 and cfg.model.num_hidden_layers == 4
    assert cfg.model.rope_scaling.rope_type == "llama3" and cfg.model.rope_theta == 50000.0
    assert cfg.model.rope_scaling.original_max_position_embeddings == 32
    with pytest.raises(ConfigError, match=r"model.hidden_size = 128 contradicts .*config.json "
                                          r"\(hidden_size: 64\)"):
        loads(f'[data]\nsource = "python-stdlib"\n[init]\nhf = "{directory}"\n'
              "[model]\nhidden_size = 128\n")
    with pytest.raises(ConfigError, match="model.rope_scaling = .* contradicts"):
        loads(f'[data]\nsource = "python-stdlib"\n[init]\nhf = "{directory}"\n'
              '[model.rope_scaling]\nrope_type = "linear"\n')
    with pytest.raises(ConfigError, match="init.hf: .*config.json does not exist"):
        loads(f'[data]\nsource = "python-stdlib"\n[init]\nhf = "{tmp_path / "nope"}"\n')


def test_unknown_rope_type_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.rope_scaling.rope_type must be one of"):
        loads('[data]\nsource = "python-stdlib"\n[model.rope_scaling]\nrope_type = "yarn"\n')
    directory = make_tiny_hf(tmp_path / "hf")
    raw = json.loads((directory / "config.json").read_text())
    raw["rope_parameters"]["rope_type"] = "yarn"
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config.json: rope_scaling.rope_type must be one of "
                                          r"default, linear, llama3 \(got 'yarn'\)"):
        loads(f'[data]\nsource = "python-stdlib"\n[init]\nhf = "{directory}"\n')


def test_missing_or_misshapen_tensors_are_named(tmp_path: Path) -> None:
    directory = make_tiny_hf(tmp_path / "hf")
    model = get_spec("llama").build(ModelConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128))
    model.to_empty(device="cpu")
    with pytest.raises(PretrainedInvalid, match="lacks 9 tensor"):
        load_pretrained(model, directory)
    model = get_spec("llama").build(ModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128))
    model.to_empty(device="cpu")
    with pytest.raises(PretrainedInvalid, match=r"mlp.gate_proj.weight has shape \[160, 64\]"):
        load_pretrained(model, directory)
