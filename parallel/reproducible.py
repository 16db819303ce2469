"""`parallel.reproducible`: a step's update is a function of the global batch and weights alone.

Whatever dp, the ZeRO stage or the resize history, every step gives the same bits
(docs/reproducible.md: the design, its error bound against fp32 and its cost). The pieces:

- Micro-batch k of a step always holds the same samples (trainer.data), so its gradient g_k is
  the same bits on whichever rank runs it, given deterministic kernels
  (`enable_deterministic_kernels`).
- `ExactGradients` takes each g_k from autograd as soon as it is accumulated into a parameter
  (a post-accumulate-grad hook on the tensor autograd writes: the parameter itself for ZeRO-1,
  FSDP2's unsharded parameter for ZeRO-2/3, so FSDP2 is left nothing to reduce), turns it into
  int64 fixed point and adds it into one flat buffer; the data-parallel sum is one int64
  reduce-scatter of that buffer. Integer sums do not depend on order, so neither the
  accumulation over micro-batches nor the reduction over ranks depends on the layout.
- Each parameter's fixed-point scale comes from micro-batch 0 of the step, which dp rank 0
  runs in every layout: its largest |g_0| is broadcast, and HEADROOM_BITS are added. When a
  later micro-batch exceeds that range (seen by an all-reduce MAX of every rank's maxima at
  the end of the step, the same verdict everywhere), the step runs again with the scale of the
  step's true maxima: a deterministic retry that always fits.
- The gradient norm for clipping and the loss are exact sums too (parallel.exact_sum).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.exact_sum import dequantize, exponent, quantize, shift_for
from parallel.zero import ShardedAdamW

# A later micro-batch may have gradients up to 2**HEADROOM_BITS times micro-batch 0's largest
# before the step has to run again; each bit costs one bit of resolution below that largest.
HEADROOM_BITS = 8


def enable_deterministic_kernels(device: torch.device) -> None:
    """Kernels whose result depends only on their inputs and shapes (process-wide settings).

    On CPU the kernels this model uses are already deterministic (checked bit for bit with 1 to
    8 threads); `use_deterministic_algorithms` makes torch raise on any op that is not. On CUDA
    cuBLAS needs a fixed workspace and cuDNN its deterministic algorithms.
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


@dataclass(frozen=True)
class _Region:
    """Where one parameter's gradient lives in the flat (dp, per_rank) int64 buffer.

    Row r of the buffer is what dp rank r receives from the reduce-scatter. A parameter's rows
    (dim 0) are split over ranks as torch.chunk splits them, which is how FSDP2 and ZeRO-1
    (parallel.zero) shard dim 0: rank r holds rows [r * chunk, (r + 1) * chunk) at `offset`.
    """

    name: str
    shape: torch.Size
    offset: int
    rows: int
    cols: int
    chunk: int

    def add(self, buffer: torch.Tensor, q: torch.Tensor) -> None:
        if self.rows == 0:
            return
        q = q.reshape(self.rows, self.cols)
        full, rest = divmod(self.rows, self.chunk)
        if full:
            span = slice(self.offset, self.offset + self.chunk * self.cols)
            buffer[:full, span].add_(q[: full * self.chunk].reshape(full, -1))
        if rest:
            buffer[full, self.offset : self.offset + rest * self.cols].add_(
                q[full * self.chunk :].reshape(-1)
            )

    def local(self, row: torch.Tensor, rank: int) -> torch.Tensor:
        n = min(self.chunk, max(0, self.rows - rank * self.chunk))
        piece = row[self.offset : self.offset + n * self.cols]
        return piece.view(n, *self.shape[1:]) if len(self.shape) else piece.view(())


class ExactGradients:
    """Fixed-point accumulation and data-parallel reduction of a step's gradients.

    Per step: `begin`, then the micro-batches' backwards (each followed by
    `micro_batch_done`), then `settle` (None, or the exponents to run the step again with),
    then `reduce` for this rank's shard of every parameter's summed gradient.
    """

    def __init__(
        self, model: nn.Module, group: dist.ProcessGroup | None, *, micro_batches: int
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        # Terms of each sum: the micro-batches holding samples (all-padding ones add zeros).
        self.terms = micro_batches
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        self.regions: list[_Region] = []
        offset = 0
        for name, p in named:
            rows = p.shape[0] if p.ndim else 1
            cols = p.numel() // rows if rows else 0
            chunk = max(1, -(-rows // self.size))
            self.regions.append(_Region(name, p.shape, offset, rows, cols, chunk))
            offset += chunk * cols
        self._index = {name: i for i, (name, _) in enumerate(named)}
        device = self.params[0].device if self.params else torch.device("cpu")
        self.buffer = torch.zeros(self.size, offset, dtype=torch.int64, device=device)
        self.retries = 0  # steps that ran again because a gradient left its range
        # The tensors autograd accumulates into, found as their modules run (FSDP2 swaps its
        # unsharded parameters in for forward and backward), kept alive so ids stay unique.
        self._hooked: dict[int, torch.Tensor] = {}
        for prefix, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is not None:
                module.register_forward_pre_hook(self._discover(prefix))
        self.begin(None)

    # -- one attempt at a step -------------------------------------------------------------

    def begin(self, exponents: list[int | None] | None) -> None:
        """Start a step; `exponents` None agrees them from micro-batch 0 (`micro_batch_done`)."""
        self.buffer.zero_()
        self.maxima = [0.0] * len(self.params)
        # (parameter index, gradient) as autograd hands them over, until the micro-batch ends.
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._agreed = exponents is not None
        self.shifts: list[int | None] = [None] * len(self.params)
        self.limits = [0.0] * len(self.params)
        if exponents is not None:
            self._use(exponents)

    def _use(self, exponents: list[int | None]) -> None:
        # A parameter without an exponent had no gradient where the scale came from: any
        # non-zero gradient of it leaves the range (limit 0).
        self.shifts = [shift_for(e, self.terms) if e is not None else None for e in exponents]
        self.limits = [math.ldexp(1.0, e) if e is not None else 0.0 for e in exponents]

    def micro_batch_done(self) -> None:
        """After each micro-batch's backward: convert and add its gradients. After the first
        micro-batch of a step, agree the scale first (from dp rank 0's, i.e. micro-batch 0's)."""
        pending, self._pending = [(i, g) for i, g in self._pending if g.numel()], []
        # One host sync for every tensor's largest |g| (aminmax: one pass, no temporary).
        largest = (
            torch.stack([torch.stack(torch.aminmax(g)).float() for _, g in pending])
            .abs()
            .amax(dim=1)
            .tolist()
            if pending
            else []
        )
        for (i, _), value in zip(pending, largest, strict=True):
            # A non-finite gradient is reported by settle(), on every rank at once.
            self.maxima[i] = max(self.maxima[i], value if math.isfinite(value) else math.inf)
        if not self._agreed:
            first = torch.tensor(self.maxima, dtype=torch.float64)
            if self.group is not None:
                dist.broadcast(first, group=self.group, group_src=0)  # micro-batch 0's maxima
            self._use(
                [
                    exponent(v) + HEADROOM_BITS if 0.0 < v < math.inf else None
                    for v in first.tolist()
                ]
            )
            self._agreed = True
        for (i, grad), value in zip(pending, largest, strict=True):
            shift = self.shifts[i]
            # Zero adds nothing; out of range (or non-finite) makes settle() run the step again.
            if shift is not None and 0.0 < value < self.limits[i]:
                self.regions[i].add(self.buffer, quantize(grad, shift))

    def settle(self) -> list[int | None] | None:
        """After the last micro-batch: None when every gradient fitted, else the exponents of
        the step's maxima over all micro-batches and ranks, to run it again with."""
        maxima = torch.tensor(self.maxima, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        values = maxima.tolist()
        bad = [r.name for r, v in zip(self.regions, values, strict=True) if not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"non-finite gradient in {', '.join(bad)}")
        if all(v == 0.0 or v < limit for v, limit in zip(values, self.limits, strict=True)):
            return None
        return [exponent(v) if v > 0.0 else None for v in values]

    def reduce(self) -> list[torch.Tensor]:
        """This rank's shard (torch.chunk of dim 0) of every parameter's summed gradient."""
        if self.size > 1:
            row = torch.empty(self.buffer.shape[1], dtype=torch.int64, device=self.buffer.device)
            dist.reduce_scatter_tensor(row, self.buffer.view(-1), group=self.group)
        else:
            row = self.buffer[0]
        out = []
        for region, shift, p in zip(self.regions, self.shifts, self.params, strict=True):
            piece = region.local(row, self.rank)
            if shift is None:  # no gradient anywhere
                out.append(torch.zeros(piece.shape, dtype=p.dtype, device=piece.device))
            else:
                out.append(dequantize(piece, shift, p.dtype))
        return out

    # -- autograd side ---------------------------------------------------------------------

    def _discover(self, prefix: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            for name, tensor in module.named_parameters(recurse=False):
                if id(tensor) in self._hooked or not tensor.requires_grad:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                if fqn not in self._index:
                    raise KeyError(f"parallel.reproducible: no parameter named {fqn}")
                self._hooked[id(tensor)] = tensor
                tensor.register_post_accumulate_grad_hook(self._harvest(self._index[fqn]))

        return hook

    def _harvest(self, i: int) -> Callable[[torch.Tensor], None]:
        @torch.no_grad()
        def hook(tensor: torch.Tensor) -> None:
            grad, tensor.grad = tensor.grad, None
            if grad is not None:
                self._pending.append((i, grad.to_local() if isinstance(grad, DTensor) else grad))

        return hook


def place_gradients(
    params: list[torch.Tensor], shards: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """Hand the reduced shards to the optimizer: ZeRO-1 slices, or FSDP2's sharded `.grad`."""
    if isinstance(optimizer, ShardedAdamW):
        optimizer.set_gradient_slices(dict(zip(params, shards, strict=True)))
        return
    for p, g in zip(params, shards, strict=True):
        if isinstance(p, DTensor):
            p.grad = DTensor.from_local(
                g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        else:
            p.grad = g.view(p.shape)
