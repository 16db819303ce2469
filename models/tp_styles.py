"""Tensor-parallel styles the families' plans share, beyond torch's column-, row-wise and
sequence-parallel ones (parallel/tensor_parallel.py applies a family's plan)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel


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
