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
  runs in every layout: its largest |g_0| is agreed (an all-reduce MAX in which only the
  holders of micro-batch 0's gradient take part), and HEADROOM_BITS are added.
- Routed experts under expert parallelism (`ExpertReduction`): a rank's experts get gradients
  from the rows of every micro-batch its ep group runs at once. Their module hands each
  source's gradient over separately (models.moe.model.Experts.gradient_sink: the same GEMMs
  as one process runs on that micro-batch), and they are summed like the others, in a buffer
  of their own reduced over the ranks holding the same experts. When a
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

from models.moe.model import Experts
from parallel.exact_sum import dequantize, exponent, quantize, shift_for
from parallel.zero import ShardedAdamW

# A later micro-batch may have gradients up to 2**HEADROOM_BITS times micro-batch 0's largest
# before the step has to run again; each bit costs one bit of resolution below that largest.
HEADROOM_BITS = 8


def enable_deterministic_kernels(device: torch.device, one_thread: bool = False) -> None:
    """Kernels whose result depends only on their inputs and shapes (process-wide settings).

    On CPU the kernels the dense model uses are already deterministic (checked bit for bit with
    1 to 8 threads); `use_deterministic_algorithms` makes torch raise on any op that is not. On
    CUDA cuBLAS needs a fixed workspace and cuDNN its deterministic algorithms.

    `one_thread` (the moe family on CPU): routed experts multiply blocks of any number of rows,
    and MKL's sgemm rounds blocks of 5-7 and 9-11 rows differently with 1 and 2 intra-op
    threads (measured on this machine's torch 2.13 CPU build; 64-row blocks and 12 to 199 rows
    agree), while `python -m trainer` gives each of dp ranks cores / dp threads. One thread in
    every layout takes the thread count out of the result.
    """
    if one_thread and device.type == "cpu":
        torch.set_num_threads(1)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


@dataclass(frozen=True)
class ExpertReduction:
    """Routed experts sharded over ep ranks: their gradients are the ep shard's (local shape)
    and sum over `group`, the ranks holding the same experts (edp), split along the dim ZeRO
    shards them on (`slice_dim`: FSDP2 dim 0; ZeRO-1 the first dim ep leaves whole)."""

    group: dist.ProcessGroup | None
    ep: int
    slice_dim: Callable[[torch.Tensor], int]


@dataclass(frozen=True)
class _Reduction:
    """One int64 buffer (size, per_rank) and the group whose reduce-scatter sums it."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    buffer: torch.Tensor


@dataclass(frozen=True)
class _Region:
    """Where one parameter's gradient lives in the flat (size, per_rank) int64 buffer of its
    reduction (0: dp; 1: the routed experts' group).

    Row r of the buffer is what rank r receives from the reduce-scatter. A parameter's `dim`
    (0 but for ZeRO-1's experts) is split over ranks as torch.chunk splits it, which is how
    FSDP2 and ZeRO-1 (parallel.zero) shard it: rank r holds [r * chunk, (r + 1) * chunk) of it
    at `offset`, the other dims in order.
    """

    name: str
    shape: torch.Size
    offset: int
    rows: int
    cols: int
    chunk: int
    dim: int = 0
    reduction: int = 0

    def add(self, buffer: torch.Tensor, q: torch.Tensor) -> None:
        if self.rows == 0:
            return
        q = q.movedim(self.dim, 0).reshape(self.rows, self.cols) if q.ndim else q.reshape(1, 1)
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
        if not len(self.shape):
            return piece.view(())
        rest = [d for i, d in enumerate(self.shape) if i != self.dim]
        return piece.view(n, *rest).movedim(0, self.dim).contiguous()


class ExactGradients:
    """Fixed-point accumulation and data-parallel reduction of a step's gradients.

    Per step: `begin`, then the micro-batches' backwards (each followed by
    `micro_batch_done`), then `settle` (None, or the exponents to run the step again with),
    then `reduce` for this rank's shard of every parameter's summed gradient.
    """

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup | None,
        *,
        micro_batches: int,
        experts: ExpertReduction | None = None,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        # dp rank of the first rank of this rank's ep group (ep is the inner part of dp), so
        # source s of the experts' exchange is dp rank source_base + s.
        self.ep = experts.ep if experts is not None else 1
        self.source_base = self.rank - self.rank % self.ep
        # Terms of each sum: the micro-batches holding samples (all-padding ones add zeros).
        self.terms = micro_batches
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        groups = [group] if experts is None else [group, experts.group]
        sizes = [dist.get_world_size(g) if g is not None else 1 for g in groups]
        ends = [0] * len(groups)
        self.regions: list[_Region] = []
        for name, p in named:
            shape, dim, red = p.shape, 0, 0
            if experts is not None and _ep_sharded(p):
                shape = torch.Size((p.shape[0] // experts.ep, *p.shape[1:]))
                dim, red = experts.slice_dim(p), 1
            rows = shape[dim] if len(shape) else 1
            cols = math.prod(shape) // rows if rows else 0
            chunk = max(1, -(-rows // sizes[red]))
            self.regions.append(_Region(name, shape, ends[red], rows, cols, chunk, dim, red))
            ends[red] += chunk * cols
        self._index = {name: i for i, (name, _) in enumerate(named)}
        device = self.params[0].device if self.params else torch.device("cpu")
        self.reductions = [
            _Reduction(g, n, dist.get_rank(g) if g is not None else 0,
                       torch.zeros(n, end, dtype=torch.int64, device=device))
            for g, n, end in zip(groups, sizes, ends, strict=True)
        ]
        self.retries = 0  # steps that ran again because a gradient left its range
        # The tensors autograd accumulates into, found as their modules run (FSDP2 swaps its
        # unsharded parameters in for forward and backward), kept alive so ids stay unique.
        self._hooked: dict[int, torch.Tensor] = {}
        for prefix, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is not None:
                module.register_forward_pre_hook(self._discover(prefix))
            if isinstance(module, Experts):
                module.gradient_sink = self._source_sink(prefix)
        self.begin(None)

    # -- one attempt at a step -------------------------------------------------------------

    def begin(self, exponents: list[int | None] | None) -> None:
        """Start a step; `exponents` None agrees them from micro-batch 0 (`micro_batch_done`)."""
        for reduction in self.reductions:
            reduction.buffer.zero_()
        self.maxima = [0.0] * len(self.params)
        self.round = 0  # micro-batches of the step this rank has run
        # (parameter index, gradient, whether it is micro-batch 0's) as autograd hands them
        # over, until the micro-batch ends.
        self._pending: list[tuple[int, torch.Tensor, bool]] = []
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
        micro-batch of a step, agree the scale first (from micro-batch 0's gradients)."""
        pending, self._pending = [x for x in self._pending if x[1].numel()], []
        # One host sync for every tensor's largest |g| (aminmax: one pass, no temporary).
        largest = (
            torch.stack([torch.stack(torch.aminmax(g)).float() for _, g, _ in pending])
            .abs()
            .amax(dim=1)
            .tolist()
            if pending
            else []
        )
        first = torch.zeros(len(self.params), dtype=torch.float64)
        for (i, _, is_first), value in zip(pending, largest, strict=True):
            # A non-finite gradient is reported by settle(), on every rank at once.
            value = value if math.isfinite(value) else math.inf
            self.maxima[i] = max(self.maxima[i], value)
            if is_first:
                first[i] = max(float(first[i]), value)
        if not self._agreed:
            # Micro-batch 0's maxima: dp rank 0's for most parameters; for routed experts under
            # ep, those its ep group computed from dp rank 0's rows. The others add zeros.
            if self.group is not None:
                dist.all_reduce(first, op=dist.ReduceOp.MAX, group=self.group)
            self._use(
                [
                    exponent(v) + HEADROOM_BITS if 0.0 < v < math.inf else None
                    for v in first.tolist()
                ]
            )
            self._agreed = True
        self.round += 1
        for (i, grad, _), value in zip(pending, largest, strict=True):
            shift = self.shifts[i]
            # Zero adds nothing; out of range (or non-finite) makes settle() run the step again.
            if shift is not None and 0.0 < value < self.limits[i]:
                region = self.regions[i]
                region.add(self.reductions[region.reduction].buffer, quantize(grad, shift))

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
        """This rank's shard (torch.chunk of its region's dim) of every parameter's summed
        gradient (of its ep shard, for routed experts under ep)."""
        rows = []
        for r in self.reductions:
            if r.size > 1:
                row = torch.empty(r.buffer.shape[1], dtype=torch.int64, device=r.buffer.device)
                dist.reduce_scatter_tensor(row, r.buffer.view(-1), group=r.group)
            else:
                row = r.buffer[0]
            rows.append(row)
        out = []
        for region, shift, p in zip(self.regions, self.shifts, self.params, strict=True):
            piece = region.local(rows[region.reduction], self.reductions[region.reduction].rank)
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
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                self._pending.append((i, local, self.round == 0 and self.rank == 0))

        return hook

    def _source_sink(self, prefix: str) -> Callable[[int, tuple[torch.Tensor, ...]], None]:
        """An Experts module's gradients from the rows of source s of its exchange (dp rank
        source_base + s; itself without ep), one micro-batch's each."""
        indices = [self._index[f"{prefix}.{name}" if prefix else name] for name in Experts.PARAMS]

        @torch.no_grad()
        def sink(source: int, grads: tuple[torch.Tensor, ...]) -> None:
            first = self.round == 0 and self.source_base + source == 0
            for i, grad in zip(indices, grads, strict=True):
                if grad is not None:
                    self._pending.append((i, grad, first))

        return sink


def _ep_sharded(p: torch.Tensor) -> bool:
    """A routed expert's tensor under expert parallelism (sharded over the "ep" mesh dim)."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


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
