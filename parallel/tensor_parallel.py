"""Tensor and sequence parallelism with DTensor (the playbook's "Tensor Parallelism" section).

Megatron-style TP over the mesh's "tp" dim, innermost so a TP group stays inside a node. Which
layer is column- or row-wise is the model family's plan (models/<family>/sharding.py, e.g.
Llama's q/k/v and gate/up column-wise, o and down row-wise, the embedding and head on the
vocabulary); this module applies it and holds the loss every family shares (the styles the families'
plans share are models/tp_styles.py).

Without sequence parallelism the residual stream is replicated on every TP rank and each
row-wise layer ends in an all-reduce. With it ("Sequence Parallelism" section) the residual
stream and the norms are sharded on the sequence dim: the all-reduce of a row-wise layer becomes
a reduce-scatter onto the sequence shards, and the input of attention / MLP is all-gathered back
to the full sequence (the same bytes, but norms and residual activations cost 1/tp of memory).
RoPE tables stay plain tensors: attention always sees the full sequence.

Every parameter ends up a DTensor on the tp mesh (norm weights replicated), so a later FSDP2
shards all of them on the same (dp, tp) mesh and optimizers and norm clipping see one mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from models import spec_of
from parallel.layout import Layout


def apply_tensor_parallel(model: nn.Module, layout: Layout, tp_mesh: DeviceMesh) -> None:
    """Shard `model` in place over `tp_mesh` with its family's plan (a no-op for tp = 1)."""
    if tp_mesh.size() == 1:
        return
    spec_of(model).tensor_parallel(model, tp_mesh, layout.sequence_parallel)


@contextlib.contextmanager
def vocab_parallel_loss(tp: int) -> Iterator[None]:
    """Around the loss and its backward: cross-entropy on vocabulary-sharded logits.

    `loss_parallel` computes log-softmax with an all-reduce of the max and of the sum of
    exponentials, and picks the target logit on the rank that owns it, so the full logits are
    never materialised. It supports reduction="sum" with ignore_index, which is what
    `ops.loss.cross_entropy_sum` asks for.
    """
    # loss_parallel is not re-entrant (its exit unregisters the handlers an outer one needs).
    active = torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers
    if tp == 1 or active:
        yield
        return
    with loss_parallel():
        yield


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: after `vocab_parallel_loss` it is a replicated DTensor."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
