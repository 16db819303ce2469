"""The load-balancing loss in training: weighted per sequence, added through the layer's output.

The trainer opens each training micro-batch with `begin(row_weights)`, one weight per sequence
of the micro-batch: router_aux_loss_coef / global_batch for a sample, 0 for a padding slot.
Under pipeline parallelism it opens the whole step once, with the weights of all its
micro-batches in order and `rows` per micro-batch, and the pipeline `select`s micro-batch i
before each stage forward of it; a forward outside any selection (torch's shape inference on a
pipeline's first step, whose output is discarded) adds nothing.
Every MoE layer then adds coef · mean-over-the-step's-sequences of its per-sequence loss
(models.moe.router), so the step's auxiliary loss is the sum over MoE layers of that mean,
whatever dp, ep and the micro-batch size. Its gradient enters through the layer's output (an
identity whose backward also hands the loss a gradient of 1), so it needs no path of its own to
the loss: the layer's backward, which FSDP and the pipeline already schedule, carries it.
Outside `begin`/`end` (evaluation) no auxiliary loss is computed.

Under context parallelism each rank holds a share of every sequence (`shard_sequences`): the
per-sequence expert counts are summed over the cp group in each MoE layer's forward, and each
rank adds its share of the loss (models.moe.router.load_balancing_loss), so the loss summed
over cp, and its gradient, are those of the whole sequences.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.moe.router import expert_counts, load_balancing_loss


class _AddLossGradient(torch.autograd.Function):
    """Identity on `out`; backward gives `loss` the gradient 1, as if it were added to the
    objective."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, out: torch.Tensor,
                loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape  # type: ignore[attr-defined]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.loss_shape, dtype=torch.float32,  # type: ignore[attr-defined]
                                device=grad.device)


class RouterAuxLoss:
    """One model's auxiliary loss of the current micro-batch (its layers share the object),
    and the expert load of the step so far: routed copies per expert of each MoE layer, over
    the sequences `begin` counts (samples, not padding), until `take_loads`."""

    def __init__(self) -> None:
        self.row_weights: torch.Tensor | None = None
        self.counted: torch.Tensor | None = None
        self.total = torch.zeros((), device="cpu")  # built under torch.device("meta")
        self.rows = 0  # rows per micro-batch; 0: all of row_weights
        self.micro_batch: int | None = None
        self.loads: dict[int, torch.Tensor] = {}  # MoE layer index -> copies per expert
        # Context parallelism: the ranks sharing each sequence, and how many shares it has.
        self.sequence_group: dist.ProcessGroup | None = None
        self.sequence_shards = 1

    def shard_sequences(self, group: dist.ProcessGroup, shards: int) -> None:
        """Every sequence is split over the `shards` ranks of `group` (context parallelism)."""
        self.sequence_group, self.sequence_shards = group, shards

    def begin(self, row_weights: torch.Tensor, rows: int = 0,
              counted: torch.Tensor | None = None) -> None:
        """`counted` (bool per row; default: weight > 0): the rows whose routing counts
        towards the expert load."""
        self.row_weights = row_weights.float()
        self.counted = row_weights > 0 if counted is None else counted
        self.total = torch.zeros((), device=row_weights.device)
        self.rows = rows
        self.micro_batch = None if rows else 0

    def take_loads(self) -> dict[int, torch.Tensor]:
        loads, self.loads = self.loads, {}
        return loads

    def select(self, micro_batch: int) -> None:
        """The micro-batch (of a step opened with `rows`) the next forwards run."""
        self.micro_batch = micro_batch

    def end(self) -> torch.Tensor:
        """The micro-batch's auxiliary loss (detached), summed over layers."""
        self.row_weights = None
        return self.total

    def attach(self, out: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor,
               layer: int) -> torch.Tensor:
        """`out` of MoE layer `layer` whose routing gave probs (b, s, E) and experts (b, s, k)."""
        if self.row_weights is None or self.micro_batch is None or not torch.is_grad_enabled():
            return out
        assert self.counted is not None
        b = probs.shape[0]
        start = self.micro_batch * self.rows
        rows = slice(start, start + b) if self.rows else slice(None)
        weights, counted = self.row_weights[rows], self.counted[rows]
        if weights.shape[0] != b:
            raise RuntimeError(f"balancing loss: micro-batch {self.micro_batch} has no weights "
                               f"for its {b} rows ({self.row_weights.shape[0]} in the step)")
        load = torch.bincount(experts[counted].reshape(-1), minlength=probs.shape[-1])
        self.loads[layer] = self.loads[layer] + load if layer in self.loads else load
        if self.sequence_group is None:
            per_sequence = load_balancing_loss(probs, experts)
        else:
            # f needs the whole sequence's counts (integers: an exact sum); P is this share's.
            counts = expert_counts(experts, probs.shape[-1])
            dist.all_reduce(counts, group=self.sequence_group)
            per_sequence = load_balancing_loss(probs, experts, counts,
                                               probs.shape[1] * self.sequence_shards)
        loss = (per_sequence * weights).sum()
        self.total = self.total + loss.detach()
        return _AddLossGradient.apply(out, loss)
