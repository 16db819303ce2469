"""The moe family: a Llama-style decoder with mixture-of-experts MLPs (docs/moe.md).

The spec's torch-side entries import their modules when called, as Llama's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.llama import SPEC as LLAMA
from models.llama import formulas as llama_formulas
from models.moe import config, formulas, hf
from models.spec import HFAdapter, ModelSpec

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from models.model_config import ModelConfig


def _build(cfg: ModelConfig) -> nn.Module:
    from models.moe.model import build_model

    return build_model(cfg)


def _init_weights(model: nn.Module, seed: int) -> None:
    from models.moe.bias_balance import zero_expert_bias

    LLAMA.init_weights(model, seed)
    zero_expert_bias(model)


def _tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    from models.moe.sharding import apply_tensor_parallel

    apply_tensor_parallel(model, tp_mesh, sequence_parallel)


SPEC = ModelSpec(
    name="moe",
    validate=config.validate,
    build=_build,
    tie_weights=LLAMA.tie_weights,  # the same embedding and output projection
    init_weights=_init_weights,
    tensor_parallel=_tensor_parallel,
    split_stages=LLAMA.split_stages,  # a stage is a run of layers, dense or MoE alike
    param_counts=formulas.param_counts,
    param_shapes=formulas.param_shapes,
    attention_flops_per_token=llama_formulas.attention_flops_per_token,
    # Mixtral and Qwen2-MoE (models/moe/hf.py).
    hf=HFAdapter(model_types=hf.MODEL_TYPES, config_from_hf=hf.config_from_hf,
                 config_to_hf=hf.config_to_hf, tensors=hf.tensors),
)
