"""Llama's pipeline split points: a stage is a contiguous run of decoder layers; the first stage
also holds the embedding, the last the final norm and head (parallel/pipeline.py chooses which
layers each stage gets and drives the schedule).

A stage is a `Llama` with the other layers deleted from its ModuleDict and the embedding or head
set to None, so every parameter keeps the fully qualified name it has in the full model: DCP
checkpoints of any pipeline layout load into any other layout, and the model code stays
single-device. All stages of one rank share their modules with the rank's own `Llama` (the
union of its stages), which the optimizer and the checkpoint see as "the model".
"""

from __future__ import annotations

import torch
from torch import nn


def split_stages(model: nn.Module, stages: list[tuple[int, range]], n_stages: int
                 ) -> list[nn.Module]:
    """Cut `model` (on meta) to `stages` (global stage index, its layers) of `n_stages`."""
    keep = {str(i) for _, layers in stages for i in layers}
    ids = [s for s, _ in stages]
    for name in [k for k in model.layers if k not in keep]:
        del model.layers[name]
    if 0 not in ids:
        model.embed_tokens = None
    if n_stages - 1 not in ids:
        model.norm = None
        model.lm_head = None
    parts = []
    for s, layers in stages:
        with torch.device("meta"):
            part = type(model)(model.cfg)
        part.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        part.embed_tokens = model.embed_tokens if s == 0 else None
        part.norm = model.norm if s == n_stages - 1 else None
        part.lm_head = model.lm_head if s == n_stages - 1 else None
        parts.append(part)
    return parts
