"""The moe family against transformers' `MixtralForCausalLM` and `Qwen2MoeForCausalLM`, built
here with random weights: logits equal (fp32, 1e-5) through `[init] hf`; `ultrascale-hf import`
then `export` gives back every tensor's bits (fp32 and bf16 files); transformers loads the
export with our logits; a config of ours that transformers builds from our config.json has the
files our table says; config.json keys we cannot take are refused naming the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from models import get_spec
from models.moe import hf as moe_hf
from models.moe.config import moe_layers
from models.moe.formulas import moe_counts
from parallel.job import ConfigError, ModelConfig, loads
from trainer import hf_cli
from trainer.pretrained import load_pretrained

transformers = pytest.importorskip("transformers")
from examples.make_tiny_hf import make_tiny_hf  # noqa: E402

pytestmark = pytest.mark.unit
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
DATA = '[data]\nsource = "python-stdlib"\n'


def _job_model(directory: Path, extra: str = "") -> ModelConfig:
    """`[model]` of a job that names only `[init] hf`: the family comes from model_type."""
    return loads(f'{DATA}[init]\nhf = "{directory}"\n{extra}').model


def _ours(directory: Path) -> torch.nn.Module:
    cfg = _job_model(directory)
    model = get_spec(cfg.family).build(cfg)
    model.to_empty(device="cpu")
    get_spec(cfg.family).init_weights(model, 0)
    load_pretrained(model, directory)
    return model.eval()


def _theirs(directory: Path) -> torch.nn.Module:
    model_type = json.loads((directory / "config.json").read_text())["model_type"]
    return getattr(transformers, CLASSES[model_type]).from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(seed))


def _assert_same_logits(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    tokens = _tokens()
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("mixtral", {}),
        ("mixtral", {"tie_word_embeddings": True, "head_dim": None, "num_experts_per_tok": 1}),
        ("qwen2_moe", {}),
        # Layer 2 alone routes (our first_k_dense_replace 2, moe_layer_freq 2); renormalised.
        ("qwen2_moe", {"num_hidden_layers": 4, "mlp_only_layers": [0, 1, 3],
                       "norm_topk_prob": True, "qkv_bias": False, "num_experts_per_tok": 3}),
    ],
    ids=["mixtral", "mixtral-tied-k1", "qwen2moe-dense-first", "qwen2moe-every-2nd"],
)
def test_logits_equal_transformers(tmp_path: Path, model_type: str, overrides: dict) -> None:
    directory = make_tiny_hf(tmp_path / "hf", model_type=model_type, **overrides)
    ours = _ours(directory)
    if model_type == "qwen2_moe":
        cfg = ours.cfg
        assert cfg.shared_expert_gate and cfg.num_shared_experts == 2
        assert cfg.qkv_bias == overrides.get("qkv_bias", True)
        assert (cfg.first_k_dense_replace, cfg.moe_layer_freq) == (
            (2, 2) if "mlp_only_layers" in overrides and overrides["mlp_only_layers"] != [0]
            else (1, 1))
    _assert_same_logits(ours, _theirs(directory))


def test_a_gated_shared_expert_changes_the_output(tmp_path: Path) -> None:
    """The gate is applied: without it (sigmoid → 1) the logits differ from transformers'."""
    directory = make_tiny_hf(tmp_path / "hf", model_type="qwen2_moe")
    ours, theirs = _ours(directory), _theirs(directory)
    for layer in ours.layers.values():
        if getattr(layer.mlp, "shared_expert_gate", None) is not None:
            layer.mlp.shared_expert_gate = None
    with torch.no_grad():
        assert not torch.allclose(ours(_tokens()), theirs(_tokens()).logits, atol=1e-3)


def _files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out |= load_file(path)
    return out


@pytest.mark.parametrize(("model_type", "dtype"),
                         [("mixtral", "fp32"), ("qwen2_moe", "fp32"), ("qwen2_moe", "bf16")])
def test_import_export_round_trip(tmp_path: Path, model_type: str, dtype: str) -> None:
    """transformers' files -> our DCP checkpoint -> files: the same bits under the same names,
    which transformers loads with the logits of our model restored from the checkpoint."""
    src = make_tiny_hf(tmp_path / "src", model_type=model_type, dtype=dtype, seed=4)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert hf_cli.main(["import", str(src), str(ckpt)]) == 0
    # A shard limit below the model's size: experts' slices spread over several files.
    assert hf_cli.main(["export", str(ckpt), str(out), "--dtype", dtype,
                        "--max-shard-bytes", "60000"]) == 0
    assert len(list(out.glob("*.safetensors"))) > 1
    theirs, ours = _files(src), _files(out)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype, name
        assert ours[name].view(torch.uint8).equal(value.view(torch.uint8)), name
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == model_type
    if dtype == "fp32":
        _assert_same_logits(_from_checkpoint(ckpt), _theirs(out))


def _from_checkpoint(root: Path) -> torch.nn.Module:
    from checkpoint.durable import load_offline, open_offline
    from checkpoint.manifest import list_checkpoints
    from parallel.job import from_dict

    step = list_checkpoints(root)[-1][1]
    manifest, _ = open_offline(step)
    cfg = from_dict({"model": manifest.extra["model"], "data": {"source": "python-stdlib"}}).model
    model = get_spec(cfg.family).build(cfg)
    model.to_empty(device="cpu")
    get_spec(cfg.family).init_weights(model, 0)
    load_offline(step, manifest, {f"state.model.{n}": p.detach()
                                  for n, p in model.named_parameters()})
    return model.eval()


QWEN_OURS = ModelConfig(
    family="moe", hidden_size=64, intermediate_size=80, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=256,
    max_position_embeddings=128, tie_word_embeddings=True, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=3,
    shared_expert_gate=True, qkv_bias=True, first_k_dense_replace=1, moe_layer_freq=2,
    norm_topk_prob=False)
MIXTRAL_OURS = ModelConfig(
    family="moe", hidden_size=64, intermediate_size=80, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=24, vocab_size=256,
    max_position_embeddings=128, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16,
    rope_theta=5e5)


@pytest.mark.parametrize("cfg", [QWEN_OURS, MIXTRAL_OURS], ids=["qwen2moe", "mixtral"])
def test_our_config_json_builds_the_model_of_our_table(tmp_path: Path, cfg: ModelConfig) -> None:
    """transformers builds from our config.json a model whose files hold exactly the tensors
    (names and shapes) our table plans, and whose logits ours give on them: the export of a
    model that did not come from Hugging Face is one transformers reads as we mean it."""
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(moe_hf.config_to_hf(cfg)))
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("gate" in name and "proj" not in name) or p.ndim == 1:
                p.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    files = _files(directory)
    table = moe_hf.tensors(cfg)
    shapes = {n: tuple(p.shape) for n, p in _built(cfg).state_dict().items()}
    assert files.keys() == {t.hf for t in table}
    for t in table:
        want = shapes[t.ours] if t.index is None else shapes[t.ours][1:]
        assert tuple(files[t.hf].shape) == want, t
    # Equal but for the names of the same model: Mixtral's one MLP width, and the first
    # routing layer counted as the dense layers before it.
    back = _job_model(directory)
    assert moe_layers(back) == moe_layers(cfg)
    assert back == dataclasses.replace(
        cfg, first_k_dense_replace=moe_layers(cfg)[0],
        intermediate_size=cfg.intermediate_size if cfg is QWEN_OURS else 16)
    _assert_same_logits(_ours(directory), _theirs(directory))


def _built(cfg: ModelConfig) -> torch.nn.Module:
    return get_spec("moe").build(cfg)


def _edited(tmp_path: Path, model_type: str, **changes: object) -> Path:
    directory = make_tiny_hf(tmp_path / model_type, model_type=model_type)
    raw = json.loads((directory / "config.json").read_text()) | changes
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


@pytest.mark.parametrize(
    ("model_type", "changes", "message"),
    [
        ("mixtral", {"hidden_act": "gelu"}, r'hidden_act must be "silu" \(got \'gelu\'\)'),
        ("mixtral", {"sliding_window": 16}, r"sliding_window is not supported \(got 16"),
        ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise is not supported"),
        ("qwen2_moe", {"use_sliding_window": True}, r"use_sliding_window is not supported"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 48},
         r"shared_expert_intermediate_size must be a positive multiple of "
         r"moe_intermediate_size \(got 48, 32\)"),
        ("qwen2_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2},
         r"mlp_only_layers \[\] and decoder_sparse_step 2 make layers \[1\] mixtures"),
        ("qwen2_moe", {"num_experts_per_tok": 5}, r"model.num_experts_per_tok must be in"),
    ],
    ids=["hidden_act", "sliding_window", "jitter", "use_sliding_window", "shared_width",
         "sparse_step", "top_k"],
)
def test_config_json_keys_we_cannot_take_are_named(tmp_path: Path, model_type: str,
                                                    changes: dict, message: str) -> None:
    directory = _edited(tmp_path, model_type, **changes)
    with pytest.raises(ConfigError, match=message):
        _job_model(directory)


def test_family_and_contradictions(tmp_path: Path) -> None:
    directory = make_tiny_hf(tmp_path / "hf", model_type="mixtral")
    assert _job_model(directory).family == "moe"
    # The job's own balancing weight stands (our loss is not transformers').
    assert _job_model(directory, "[model]\nrouter_aux_loss_coef = 0.05\n"
                      ).router_aux_loss_coef == 0.05
    with pytest.raises(ConfigError, match=r"model.num_experts = 8 contradicts .*\(num_experts: 4\)"):
        _job_model(directory, '[model]\nfamily = "moe"\nnum_experts = 8\n')
    with pytest.raises(ConfigError, match=r'model_type must be "llama" .*\(got \'mixtral\'\)'):
        _job_model(directory, '[model]\nfamily = "llama"\n')
    llama = make_tiny_hf(tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"model_type must be one of mixtral, qwen2_moe"):
        _job_model(llama, '[model]\nfamily = "moe"\n')


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shared_expert_gate": False}, r"model.num_shared_experts = 3: no Hugging Face model"),
        ({"num_shared_experts": 0, "shared_expert_gate": False, "qkv_bias": False,
          "norm_topk_prob": True}, r"model.first_k_dense_replace = 1: no Hugging Face"),
        ({"router_bias_update_rate": 0.001}, r"model.router_bias_update_rate: Mixtral and "),
        ({"attention_bias": True}, r"model.attention_bias: Qwen2-MoE has no o_proj bias"),
    ],
    ids=["ungated-shared", "dense-first-no-shared", "routing-bias", "o-bias"],
)
def test_models_no_hf_type_holds_are_refused_on_export(changes: dict, message: str) -> None:
    cfg = dataclasses.replace(QWEN_OURS, **changes)
    with pytest.raises(ConfigError, match=message):
        moe_hf.config_to_hf(cfg)
    with pytest.raises(ConfigError, match=message):
        moe_hf.tensors(cfg)


def test_new_fields_are_checked_and_counted() -> None:
    with pytest.raises(ConfigError, match="model.shared_expert_gate needs model.num_shared"):
        loads(DATA + '[model]\nfamily = "moe"\nnum_experts = 4\nshared_expert_gate = true\n')
    with pytest.raises(ConfigError, match="model.qkv_bias and model.shared_expert_gate need"):
        loads(DATA + "[model]\nqkv_bias = true\n")
    spec = get_spec("moe")
    model = _built(QWEN_OURS)
    names = dict(model.named_parameters())
    assert "layers.2.self_attn.q_proj.bias" in names and "layers.2.self_attn.o_proj.bias" \
        not in names and names["layers.2.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert moe_counts(QWEN_OURS).total == sum(p.numel() for p in model.parameters())
    moe_layer = sum(p.numel() for p in model.layers["2"].parameters())
    assert sum(torch.Size(s.shape).numel() for s in spec.param_shapes(QWEN_OURS)["layer"]) == (
        moe_layer)
