"""Tensor and sequence parallelism with DTensor (the playbook's "Tensor Parallelism" section).

Megatron-style TP over the mesh's "tp" dim, innermost so a TP group stays inside a node. Which
layer is column- or row-wise is the model family's plan (models/<family>/sharding.py, e.g.
Llama's q/k/v and gate/up column-wise, o and down row-wise, the embedding and head on the
vocabulary); this module applies it and holds the styles and the loss every family shares.

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
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel, loss_parallel

from models import spec_of
from parallel.layout import Layout


class ReplicateParallel(ParallelStyle):
    """A module whose parameters and input are replicated over TP (a norm without SP).

    Its parameters become replicated DTensors so every parameter of the model lives on the tp
    mesh; input and output stay plain tensors. Gradients are identical on all TP ranks (the
    replicated input's gradient was all-reduced by the column-wise layer downstream).
    """

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                p_name,
                nn.Parameter(DTensor.from_local(param, mesh, [Replicate()], run_check=False)),
            )

    @staticmethod
    def _input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    @staticmethod
    def _output_fn(mod: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._replicate_params, self._input_fn, self._output_fn
        )


def norm_style(sp: bool) -> ParallelStyle:
    return SequenceParallel() if sp else ReplicateParallel()


def apply_tensor_parallel(model: nn.Module, layout: Layout, tp_mesh: DeviceMesh) -> None:
    """Shard `model` in place over `tp_mesh` with its family's plan (a no-op for tp = 1)."""
    if tp_mesh.size() == 1:
        return
    spec_of(model).tensor_parallel(model, layout, tp_mesh)


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
