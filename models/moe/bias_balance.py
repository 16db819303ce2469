"""DeepSeek-V3's auxiliary-loss-free load balancing (DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report", section 2.1.2), `model.router_bias_update_rate` = γ > 0.

Each MoE layer holds a bias b (one value per expert) that is added to the router's scores to
choose the top-k experts, and never to the weights. After every applied step,
b_e += γ · sign(mean load − load_e): an expert that got more than its share of the step's routed
copies becomes less likely to be chosen, one below its share more likely.

The load is the step's global count of routed copies per expert (the trainer sums it over every
rank before anything reads it), an integer vector identical on every rank and independent of
the layout; the update is therefore the same float32 operation on every rank and in one process,
and the bias, like the routing, does not depend on dp, ep or the micro-batch size. A skipped
step (non-finite loss or gradients) moves no bias, as it moves no weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from models.moe.model import MoE


def update_expert_bias(model: nn.Module, load: Mapping[int, Sequence[int]], rate: float) -> None:
    """Move every MoE layer's bias in `model` (this rank's layers) toward balance.

    `load`: decoder layer index → routed copies per expert in the step just applied."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoE) and module.expert_bias is not None:
                counts = torch.tensor(load[module.layer], dtype=torch.float64)
                step = torch.sign(counts.mean() - counts) * rate
                module.expert_bias += step.to(module.expert_bias)


def zero_expert_bias(model: nn.Module) -> None:
    """The bias of a new model (materialised from meta, so uninitialised): zero."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoE) and module.expert_bias is not None:
                module.expert_bias.zero_()
