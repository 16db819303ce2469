"""AdamW that updates each DTensor parameter through its local shard.

AdamW's update is elementwise: for a parameter whose gradient and moments are sharded exactly as
it is (FSDP2's Shard(0), tensor parallelism's Shard/Replicate, never Partial), DTensor runs each
of the update's ops on the local shards and nothing else. Dispatching those ops through DTensor
costs a sharding propagation per op and tensor layout, which is cached per mesh: the first step
of every new world (every recovery) paid dozens of them, most of that step's time, and each warm
step still pays the dispatch (docs/architecture.md, "Costs behind the code").

`ShardLocalAdamW` hands torch's own AdamW implementation the local shards instead, so the same
ops run on the same local data: the result is bit-identical to `torch.optim.AdamW` on the
DTensors (tests/distributed/test_shard_local_adamw.py). Parameters it cannot do that for (a
gradient placed differently from its parameter, e.g. Partial) keep DTensor's path; a group
asking for the fused, capturable or differentiable implementation is refused at its first step
(ValueError). The state dict is AdamW's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial
from torch.optim.adam import adam
from torch.optim.optimizer import _default_to_fused_or_foreach

from checkpoint.optimizer_state import prime_adam_state


def _same_layout(param: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether `param` and `others` are DTensors sharded alike with no pending reduction."""
    if not isinstance(param, DTensor):
        return False
    if any(isinstance(p, Partial) for p in param.placements):
        return False
    return all(isinstance(t, DTensor) and t.device_mesh == param.device_mesh
               and t.placements == param.placements for t in others)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # the storage the DTensor updates


class ShardLocalAdamW(torch.optim.AdamW):
    def init_state(self) -> None:
        """Create AdamW's state, zeroed, before a load (checkpoint.optimizer_state)."""
        prime_adam_state(self)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["fused"] or group["differentiable"] or group["capturable"]:
                raise ValueError(
                    "ShardLocalAdamW: fused, differentiable and capturable are not supported")
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            has_complex = self._init_group(
                group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if not params:
                continue
            foreach = group["foreach"]
            if foreach is None:  # torch's default, decided on the DTensors as AdamW would
                _, foreach = _default_to_fused_or_foreach(params, False, use_fused=False)
            amsgrad = group["amsgrad"]
            moments = [(grads[i], exp_avgs[i], exp_avg_sqs[i],
                        *((max_exp_avg_sqs[i],) if amsgrad else ())) for i in range(len(params))]
            local = [_same_layout(p, *m) for p, m in zip(params, moments, strict=True)]
            # foreach takes one kind of tensor per list: all local shards, or DTensor's path.
            if not foreach or all(local):
                for i in (i for i, ok in enumerate(local) if ok):
                    params[i], grads[i] = _local(params[i]), _local(grads[i])
                    exp_avgs[i], exp_avg_sqs[i] = _local(exp_avgs[i]), _local(exp_avg_sqs[i])
                    if amsgrad:
                        max_exp_avg_sqs[i] = _local(max_exp_avg_sqs[i])
            beta1, beta2 = group["betas"]
            adam(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                amsgrad=amsgrad, has_complex=has_complex, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=group["maximize"], foreach=foreach, capturable=False,
                differentiable=False, fused=False, decoupled_weight_decay=True,
            )
        return loss
