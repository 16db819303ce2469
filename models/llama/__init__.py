"""The Llama family: Llama 1-3.x and Llama-architecture models (SmolLM, TinyLlama, ...).

The spec's torch-side entries import their modules when called, so that the planner and the job
parser use the pure ones without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.llama import config, formulas
from models.spec import HFAdapter, ModelSpec

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from models.model_config import ModelConfig


def _build(cfg: ModelConfig) -> nn.Module:
    from models.llama.model import build_model

    return build_model(cfg)


def _tie_weights(model: nn.Module) -> None:
    from models.llama.model import tie_weights

    tie_weights(model)  # type: ignore[arg-type]


def _init_weights(model: nn.Module, seed: int) -> None:
    from models.llama.model import init_weights

    init_weights(model, seed)


def _tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    from models.llama.sharding import apply_tensor_parallel

    apply_tensor_parallel(model, tp_mesh, sequence_parallel)


def _split_stages(model: nn.Module, stages: list[tuple[int, range]], n_stages: int
                  ) -> list[nn.Module]:
    from models.llama.pipeline import split_stages

    return split_stages(model, stages, n_stages)


SPEC = ModelSpec(
    name="llama",
    validate=config.validate,
    build=_build,
    tie_weights=_tie_weights,
    init_weights=_init_weights,
    tensor_parallel=_tensor_parallel,
    split_stages=_split_stages,
    param_counts=formulas.param_counts,
    param_shapes=formulas.param_shapes,
    attention_flops_per_token=formulas.attention_flops_per_token,
    hf=HFAdapter(
        model_types=("llama",),
        config_from_hf=config.config_from_hf,
        config_to_hf=config.config_to_hf,
        tensors=config.tensors,
    ),
)
