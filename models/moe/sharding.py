"""The moe family's tensor-parallel plan: Llama's for attention, norms, embedding, head and
dense MLPs; a MoE MLP is replicated over tp.

Every tp rank runs the whole MoE layer on the (replicated) residual stream: the router and the
shared experts become replicated DTensors on the tp mesh (so FSDP2 finds every parameter of a
block on one mesh), the routed experts stay on their own ep mesh (parallel.expert_parallel).
Their gradients are identical on every tp rank, like a norm's. Sharding the experts' matrices
over tp (or tp ranks taking different experts) is not built yet; nor is sequence parallelism,
whose sequence-sharded residual stream the MoE layer would first have to gather.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from models.llama.sharding import block_plan, root_plan
from models.moe.model import MoE
from models.tp_styles import ReplicateParallel


def moe_block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    plan = {k: v for k, v in block_plan(sp=False).items() if not k.startswith("mlp.")}
    plan["mlp.gate"] = ReplicateParallel()
    if block.mlp.shared_experts is not None:
        plan["mlp.shared_experts"] = ReplicateParallel()
    if block.mlp.shared_expert_gate is not None:
        plan["mlp.shared_expert_gate"] = ReplicateParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    if sequence_parallel:
        raise ValueError("model.family \"moe\" does not support parallel.sequence_parallel yet")
    if model.cfg.tie_word_embeddings:
        raise ValueError("parallel.tp > 1 does not support model.tie_word_embeddings")
    for block in model.layers.values():
        plan = moe_block_plan(block) if isinstance(block.mlp, MoE) else block_plan(sp=False)
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(model, tp_mesh, root_plan(model, sp=False))
