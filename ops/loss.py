"""Token-summed cross-entropy.

The trainer divides by the global token count of the step itself (docs/architecture.md, the
promise (c)), so losses here are sums, never means: a mean per rank or per micro-batch would
weight tokens differently depending on how the batch was split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token losses; targets equal to IGNORE_INDEX contribute nothing."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_tokens(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE_INDEX).sum()
