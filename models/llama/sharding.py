"""Llama's tensor/sequence-parallel plan (parallel/tensor_parallel.py explains the styles;
models/tp_styles.py holds the ones torch lacks).

- attention: q/k/v column-wise (each rank holds num_heads / tp query heads and
  num_key_value_heads / tp KV heads, so GQA stays local), o row-wise;
- MLP: gate/up column-wise, down row-wise;
- embedding row-wise on the vocabulary dim, LM head column-wise with its output left sharded on
  the vocabulary, so that `vocab_parallel_loss` computes the loss without gathering the logits.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from models.tp_styles import norm_style


def block_plan(sp: bool) -> dict[str, ParallelStyle]:
    """The plan of one decoder layer, by submodule name."""
    seq = Shard(1)
    # With SP, row-wise outputs are reduce-scattered onto sequence shards, and attention / MLP
    # inputs (sequence-sharded DTensors out of the norms) are all-gathered first.
    row_out = seq if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": norm_style(sp),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=row_out),
        "post_attention_layernorm": norm_style(sp),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=row_out),
    }
    if sp:
        # cos/sin (the RoPE tables) are passed through untouched.
        plan["self_attn"] = PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return plan


def root_plan(model: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    """Embedding, final norm and head, for those this model (or pipeline stage) has."""
    seq = Shard(1)
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "embed_tokens", None) is not None:
        plan["embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq if sp else Replicate()
        )
    if getattr(model, "norm", None) is not None:
        plan["norm"] = norm_style(sp)
    if getattr(model, "lm_head", None) is not None:
        # Logits stay a DTensor sharded on the vocabulary: the loss never gathers them.
        plan["lm_head"] = ColwiseParallel(
            input_layouts=seq if sp else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,
        )
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    if model.cfg.tie_word_embeddings:
        # Row-wise embedding and column-wise head shard the shared matrix on different dims.
        raise ValueError("parallel.tp > 1 does not support model.tie_word_embeddings")
    sp = sequence_parallel
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sp))
    parallelize_module(model, tp_mesh, root_plan(model, sp))
