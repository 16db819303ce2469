"""What a model family hands the rest of the code base: one frozen `ModelSpec`.

`parallel/`, `trainer/` and the planner ask the spec of `model.family` for everything that
depends on the architecture: the module, its tensor/sequence-parallel plan, how its layers are cut
into pipeline stages, its parameter and FLOP counts, and the mapping to Hugging Face names and
config fields. This module is pure (no torch): the planner and the job parser import it, and a
spec's torch-side callables import their modules only when called.

A family's module must keep its decoder blocks in a `layers` ModuleDict keyed by index, each with
a `self_attn` whose `core` is the attention function (context parallelism, recompute and FSDP2
wrap those), and must be built on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from models.model_config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model, by where they live."""

    per_layer: int  # one decoder layer, its norms included (unequal layers: the mean, rounded up)
    per_layer_norms: int  # the part of `per_layer` that TP replicates instead of sharding
    embedding: int
    head: int  # 0 when tied to the embedding
    final_norm: int
    num_layers: int
    # Parameters a token does not use: the routed experts beyond its top-k (0 for dense
    # models). Compute follows total - inactive; memory the total.
    inactive: int = 0

    @property
    def active(self) -> int:
        return self.total - self.inactive

    @property
    def total(self) -> int:
        return self.per_layer * self.num_layers + self.embedding + self.head + self.final_norm


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor and the dim tensor parallelism splits (None: replicated).

    `whole_grad`: the gradient comes out of autograd replicated over tp (the whole tensor),
    however the weight is split (a vocabulary-parallel embedding's).
    `ep_dim`: the dim expert parallelism splits over ep (a routed-expert tensor's expert dim);
    such a tensor's ZeRO group is dp / ep instead of dp."""

    shape: tuple[int, ...]
    tp_dim: int | None
    whole_grad: bool = False
    ep_dim: int | None = None


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a Hugging Face model's weight files and where its values live in ours.

    Most map one to one (`index` None: the whole of our tensor `ours`). A MoE layer's routed
    experts are one (E, ·, ·) tensor here, so that expert parallelism can shard dim 0, but one
    file tensor per expert there: each of those is the slice `ours[index]`."""

    hf: str
    ours: str
    index: int | None = None


@dataclass(frozen=True)
class HFAdapter:
    """Between our names and fields and Hugging Face's for one family.

    `model_types`: the config.json `model_type`s the family reads; `config_from_hf` turns a
    config.json into `[model]` fields (raising ConfigError naming the key it cannot take);
    `config_to_hf` the other way (raising ConfigError naming the field no model type has);
    `tensors` lists every tensor of a full model's files, in file order, with where it lives in
    ours. The table depends on the config, not only on names: Mixtral and Qwen2-MoE name the
    same router differently, and a stacked tensor has one file tensor per expert."""

    model_types: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any], str], dict[str, Any]]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    tensors: Callable[[ModelConfig], list[HFTensor]]

    def hf_names(self, m: ModelConfig) -> list[str]:
        return [t.hf for t in self.tensors(m)]

    def by_ours(self, m: ModelConfig) -> dict[str, list[HFTensor]]:
        """Our tensor name -> its file tensors (one, or a stacked tensor's by index)."""
        out: dict[str, list[HFTensor]] = {}
        for t in self.tensors(m):
            out.setdefault(t.ours, []).append(t)
        for parts in out.values():
            parts.sort(key=lambda t: -1 if t.index is None else t.index)
        return out


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # Family-specific checks of `[model]`, raising ConfigError naming the field.
    validate: Callable[[ModelConfig], None]
    # The single-device module on the meta device; once materialised (`to_empty`), the ties
    # between its parameters again (no values); its initial weights from (seed, name), ties
    # included. A restore that loads every parameter needs only the ties.
    build: Callable[[ModelConfig], nn.Module]
    tie_weights: Callable[[nn.Module], None]
    init_weights: Callable[[nn.Module, int], None]
    # Shard a built module in place over the tp mesh (its TP plan; with sequence parallelism
    # when the flag says so).
    tensor_parallel: Callable[[nn.Module, DeviceMesh, bool], None]
    # Cut a built module to the given stages: (global stage index, its layer indices), of
    # `n_stages`; returns one module per stage (pipeline split points).
    split_stages: Callable[[nn.Module, list[tuple[int, range]], int], list[nn.Module]]
    # Size formulas (pure).
    param_counts: Callable[[ModelConfig], ParamCounts]
    param_shapes: Callable[[ModelConfig], dict[str, tuple[ParamShape, ...]]]
    attention_flops_per_token: Callable[[ModelConfig, int], float]
    hf: HFAdapter
