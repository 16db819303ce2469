"""The step loop: one optimizer step over the step's global batch.

Loss normalisation (docs/architecture.md, "The promise" (c)): every micro-batch's token-summed loss is
divided by the global token count of the step, and FSDP sums gradients over data-parallel
ranks. The gradient is then that of the mean token loss over the whole global batch, whatever
dp, micro_batch and the padding are, so any layout follows the same trajectory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from checkpoint.state import Progress, TrainState
from models import get_spec
from models.moe.aux_loss import RouterAuxLoss
from models.moe.bias_balance import update_expert_bias
from models.moe.config import moe_layers
from ops.loss import IGNORE_INDEX, count_tokens, cross_entropy_sum
from parallel import grad_norm
from parallel.exact_sum import exact_slot_sum, exact_squared_norm
from parallel.job import JobConfig, TrainConfig
from parallel.layout import Layout, predicted_bubble
from parallel.materialize import materialize
from parallel.mesh import data_mesh, expert_data_mesh, has_experts_dim
from parallel.mixed_precision import compute_context
from parallel.parallelize import parallelize
from parallel.pipeline import Pipeline
from parallel.recompute import RecomputeMeter
from parallel.reproducible import (
    ExactGradients,
    ExpertReduction,
    enable_deterministic_kernels,
    place_gradients,
)
from parallel.tensor_parallel import local_loss, vocab_parallel_loss
from parallel.zero import ShardedAdamW
from trainer.agreement import Agreement, agree_step
from trainer.data import MicroBatch, SampleStream, open_stream, step_micro_batches
from trainer.evaluation import eval_due, eval_micro_batches, eval_rounds, open_eval_stream
from trainer.fault_injection import NonFiniteInjection
from trainer.memory_meter import MeasuredMemory
from trainer.nonfinite import SkipStreak
from trainer.shard_local_adamw import ShardLocalAdamW
from trainer.telemetry import device_name, mfu, model_flops_per_token, peak_flops


@dataclass(frozen=True)
class StepResult:
    step: int  # 1-based number of the step just completed
    loss: float
    consumed_samples: int
    tokens: int
    grad_norm: float
    step_seconds: float
    # Pipeline idle fraction (parallel.pipeline), None without pipeline parallelism: this
    # rank's measurement, the playbook's prediction, and every pp rank's (in pp rank order).
    bubble_ratio_measured: float | None = None
    bubble_ratio_predicted: float | None = None
    bubble_ratio_pp_ranks: tuple[float, ...] = ()
    # Time this rank spent re-running forward inside backward (parallel.recompute), and its
    # share of the step; 0 without recomputation.
    recompute_seconds: float = 0.0
    recompute_ratio: float = 0.0
    # This rank's memory by kind (trainer.memory_meter), when the caller measured the step.
    memory: MeasuredMemory | None = None
    lr: float = 0.0  # the schedule's learning rate of this step
    mfu: float | None = None  # model FLOPs utilisation (trainer.telemetry); None: peak unknown
    skipped: str = ""  # why the update was skipped on every rank (trainer.nonfinite); "" none
    # Mean token loss of the held-out set after this step's update (trainer.evaluation); None
    # at steps without an evaluation.
    eval_loss: float | None = None
    # The moe family (models/moe): the step's balancing loss (part of `loss`), and routed
    # copies per expert of each MoE layer over the step's samples (every rank's tokens).
    aux_loss: float | None = None
    expert_load: tuple[tuple[int, ...], ...] = ()
    # The agent's requests as agreed by every rank inside this step (trainer.agreement); none
    # outside a worker.
    agreed: Agreement = Agreement()


def learning_rate(t: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine (or constant) decay to min_lr at train.steps; step is 0-based.

    Depends on the job's total steps only, never on where a run was stopped or resumed.
    """
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(
    model: torch.nn.Module,
    t: TrainConfig,
    zero1_dp_mesh: DeviceMesh | None = None,
    expert_dp_mesh: DeviceMesh | None = None,
) -> torch.optim.Optimizer:
    """AdamW, updating DTensors through their local shards (trainer/shard_local_adamw.py); with
    `zero1_dp_mesh`, ZeRO-1's AdamW whose state is sharded over that dp mesh (routed experts'
    over `expert_dp_mesh` under expert parallelism)."""
    # Decay matrices only; norms (1-D) keep their scale. DTensor.ndim is the global ndim.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if zero1_dp_mesh is not None:
        return ShardedAdamW(
            groups,
            zero1_dp_mesh,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            weight_decay=t.weight_decay,
            expert_dp_mesh=expert_dp_mesh,
        )
    return ShardLocalAdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm



def _nothing() -> None:
    pass

class Trainer:
    """Builds the model for a layout and runs steps. `mesh=None` is the single-process reference.

    `initial_weights=False` leaves the parameters' values undrawn (allocated, tied, buffers
    built): for a caller that restores every parameter next, or calls `draw_initial_weights()`
    first (trainer/driver.py's restore tiers). Drawing them costs every rank a full tensor per
    parameter, which a restore would overwrite at once."""

    def __init__(
        self,
        cfg: JobConfig,
        layout: Layout,
        mesh: DeviceMesh | None,
        device: torch.device,
        stream: SampleStream | None = None,
        inject: NonFiniteInjection | None = None,
        initial_weights: bool = True,
        model: nn.Module | None = None,
    ) -> None:
        self.cfg, self.layout, self.mesh, self.device = cfg, layout, mesh, device
        self.rank = dist.get_rank() if mesh is not None else 0
        # Called before the optimizer changes the state in place: a snapshot's copy of the
        # previous step must be done by then (trainer.snapshots.Snapshots.fence).
        self.before_update: Callable[[], None] = _nothing
        self.inject, self._inject_loss = inject, False
        self.skips = SkipStreak(cfg.train.max_skipped_steps)
        self.devices = mesh.size() if mesh is not None else 1
        self.peak_flops = peak_flops(device_name(device), layout.mixed_precision)
        self.flops_per_step = model_flops_per_token(cfg) * cfg.train.global_batch * cfg.train.seq_len
        if cfg.parallel.reproducible:
            enable_deterministic_kernels(device, one_thread=cfg.model.family == "moe")
        self.spec = get_spec(cfg.model.family)
        # `model`: this config's module, built ahead on the meta device (trainer.model_ahead).
        self.model = model if model is not None else self.spec.build(cfg.model)
        # With pp > 1, self.model is this rank's union of stages and parts are the stages.
        self.recompute = RecomputeMeter()
        parts = (
            parallelize(self.model, layout, mesh, self.recompute)
            if mesh is not None
            else [self.model]
        )
        self.parts = parts
        materialize(self.model, device)
        self.spec.tie_weights(self.model)
        if initial_weights:
            self.draw_initial_weights()  # the buffers too
        else:
            for part in parts:
                part.init_buffers(device)
        zero1 = data_mesh(mesh) if mesh is not None and layout.zero == 1 else None
        expert_dp = expert_data_mesh(mesh) if mesh is not None and has_experts_dim(mesh) else None
        self.optimizer = build_optimizer(self.model, cfg.train, zero1, expert_dp)
        # The moe family's load-balancing loss (models.moe.aux_loss); None for dense models.
        self.router_aux: RouterAuxLoss | None = getattr(self.model, "router_aux", None)
        self._aux_sum = torch.zeros((), device=device)  # the step's balancing loss so far
        self.progress = Progress()
        self.state = TrainState(self.model, self.optimizer, self.progress)
        self.stream = stream or open_stream(
            cfg.data, cfg.train.seq_len, cfg.train.seed, cfg.model.vocab_size
        )
        self.eval_stream = open_eval_stream(cfg)
        # The token count a micro-batch's summed loss is divided by: the step's, or the held-out
        # set's while evaluating.
        self._loss_tokens = self.step_tokens
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self.cp_rank = mesh["cp"].get_local_rank() if mesh is not None else 0
        # Loss and token sums reduce over dp x cp: each cp rank holds a share of the tokens.
        self.dp_group = data_mesh(mesh).get_group() if mesh is not None else None
        self.pp_group = mesh["pp"].get_group() if mesh is not None and layout.pp > 1 else None
        # parallel.reproducible: exact sums over the micro-batches that hold samples; routed
        # experts under ep over the ranks holding the same experts, split as ZeRO splits them.
        experts = (
            ExpertReduction(expert_dp.get_group(), layout.ep, self.optimizer.slice_dim
                            if isinstance(self.optimizer, ShardedAdamW) else lambda _: 0)
            if expert_dp is not None else None
        )
        self.exact = (
            ExactGradients(
                self.model,
                self.dp_group,
                micro_batches=-(-cfg.train.global_batch // layout.micro_batch),
                experts=experts,
            )
            if cfg.parallel.reproducible
            else None
        )
        self.pipeline = (
            Pipeline(parts, layout, self.pp_group, device, self._micro_batch_loss,
                     self.router_aux.select if self.router_aux is not None else None)
            if self.pp_group is not None
            else None
        )

    def draw_initial_weights(self) -> None:
        """Random weights from (seed, name), the same at any layout (and the initial value of
        every persistent buffer): the state of step 0 without pretrained weights."""
        self.spec.init_weights(self.model, self.cfg.train.seed)
        for part in self.parts:
            part.init_buffers(self.device)

    @property
    def step_tokens(self) -> int:
        """Target tokens in a step's global batch: the loss denominator (padding excluded)."""
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    def _micro_batch_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # With tp > 1 the logits are sharded on the vocabulary and this runs (with its backward)
        # under `vocab_parallel_loss`; the loss is then a replicated DTensor, made local here
        # (to_local is differentiable) so that callers and the pipeline see plain tensors.
        loss = local_loss(cross_entropy_sum(logits, targets) / self._loss_tokens)
        return loss * math.nan if self._inject_loss else loss

    def _open_aux(self, targets: torch.Tensor, rows: int = 0) -> None:
        """Per-sequence weights of the balancing loss: coef / global_batch for a sample, 0 for
        a padding slot, so the step's loss is coef x the mean over its samples (per layer)."""
        assert self.router_aux is not None
        real = (targets != IGNORE_INDEX).any(dim=-1)
        coef = self.cfg.model.router_aux_loss_coef / self.cfg.train.global_batch
        self.router_aux.begin(real.to(torch.float32) * coef, rows=rows, counted=real)

    def _balance_experts(self, measured: dict) -> None:
        """Auxiliary-loss-free balancing (models.moe.bias_balance), after an applied update."""
        rate = self.cfg.model.router_bias_update_rate
        if rate > 0:
            if "expert_load" not in measured:
                raise RuntimeError("model.router_bias_update_rate needs the step's expert load, "
                                   "which this step path does not measure")
            load = dict(zip(moe_layers(self.cfg.model), measured["expert_load"], strict=True))
            update_expert_bias(self.model, load, rate)

    def _expert_stats(self, aux: torch.Tensor, exact_aux: float | None = None) -> dict:
        """The step's balancing loss and expert load, summed over every rank's tokens (dp) and
        stages (pp); tp ranks hold the same. `exact_aux`: the loss already summed exactly
        (parallel.reproducible; `aux` is then ignored)."""
        assert self.router_aux is not None
        loads = self.router_aux.take_loads()
        layers = moe_layers(self.cfg.model)
        e = self.cfg.model.num_experts
        stats = torch.zeros(1 + len(layers) * e, dtype=torch.float64, device=self.device)
        stats[0] = aux.to(torch.float64)
        for n, layer in enumerate(layers):
            if layer in loads:
                stats[1 + n * e:1 + (n + 1) * e] = loads[layer].to(torch.float64)
        for group in (self.dp_group, self.pp_group):
            if group is not None:
                dist.all_reduce(stats, group=group)
        counts = stats[1:].round().to(torch.int64).view(len(layers), e).tolist()
        return {"aux_loss": float(stats[0].item()) if exact_aux is None else exact_aux,
                "expert_load": tuple(tuple(row) for row in counts)}

    def train_step(self, seen: Callable[[], Agreement] | None = None) -> StepResult:
        """One step. `seen`: the agent's requests this rank has seen, asked for when the step
        reaches its agreement (trainer.agreement); the result carries their agreed maximum."""
        t, layout = self.cfg.train, self.layout
        step = self.progress.step
        start = time.perf_counter()
        self.recompute.reset()
        lr = learning_rate(t, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._inject_loss = self._injects(step + 1, "loss")
        batches = step_micro_batches(
            self.stream,
            step,
            t.global_batch,
            layout.dp,
            self.dp_rank,
            layout.micro_batch,
            layout.grad_accum,
            layout.cp,
            self.cp_rank,
        )
        measured: dict = {}  # pipeline bubble and expert statistics, as StepResult fields
        exact_grads: list[torch.Tensor] | None = None
        if self.exact is not None:
            loss, counted, exact_grads, measured = self._exact_forward_backward(batches)
        else:
            self._aux_sum = torch.zeros((), device=self.device)
            loss, counted, measured = self._forward_backward(batches)
            if self.router_aux is not None:
                measured |= self._expert_stats(self._aux_sum)
        if counted != self.step_tokens:
            raise RuntimeError(
                f"step {step + 1} consumed {counted} target tokens, expected {self.step_tokens}"
            )
        if self._injects(step + 1, "grad"):
            self._poison_gradients(exact_grads)
        grad_norm = self._clip_gradients(t.grad_clip, exact_grads)
        # Agreed on every rank: a skipped step changes no weight and no optimizer state, but
        # consumes its samples (trainer.nonfinite).
        agreement = agree_step(loss, grad_norm, seen() if seen is not None else Agreement(),
                               self.mesh is not None)
        skipped = agreement.skipped
        if not skipped:
            self.before_update()
            self.optimizer.step()
            self._balance_experts(measured)
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.consumed_samples += t.global_batch
        self.skips.record(self.progress.step, skipped)
        step_seconds = time.perf_counter() - start
        eval_loss = self.evaluate() if eval_due(self.cfg.eval, self.progress.step) else None
        return StepResult(
            step=self.progress.step,
            loss=loss,
            consumed_samples=self.progress.consumed_samples,
            tokens=self.step_tokens,
            grad_norm=grad_norm,
            step_seconds=step_seconds,
            **measured,
            recompute_seconds=self.recompute.seconds,
            recompute_ratio=self.recompute.seconds / step_seconds if step_seconds > 0 else 0.0,
            lr=lr,
            mfu=mfu(self.flops_per_step, step_seconds, self.devices, self.peak_flops),
            skipped=skipped,
            eval_loss=eval_loss,
            agreed=agreement.requests,
        )

    def evaluate(self) -> float:
        """The mean token loss of the held-out set (trainer.evaluation), without gradients; the
        same value on every rank. Moves neither the training stream nor the model's state."""
        assert self.eval_stream is not None, "evaluate() needs [eval] every > 0"
        e, layout = self.cfg.eval, self.layout
        expected = e.samples * self.cfg.train.seq_len
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        saved = self._loss_tokens, self._inject_loss
        self._loss_tokens, self._inject_loss = expected, False
        try:
            for round_ in range(eval_rounds(e.samples, layout.dp, layout.micro_batch,
                                            layout.grad_accum)):
                batches = eval_micro_batches(
                    self.eval_stream, round_, e.samples, layout.dp, self.dp_rank,
                    layout.micro_batch, layout.grad_accum, layout.cp, self.cp_rank,
                )
                part, counted = self._eval_forward(batches)
                loss_sum += part.to(torch.float64)
                tokens += counted
        finally:
            self._loss_tokens, self._inject_loss = saved
        if self.dp_group is not None:
            reduced = torch.stack([loss_sum, tokens.to(torch.float64)])
            dist.all_reduce(reduced, group=self.dp_group)
            loss_sum, tokens = reduced[0], reduced[1].to(torch.int64)
        if self.pp_group is not None:
            dist.all_reduce(loss_sum, group=self.pp_group)  # held by the last stage's rank
        if int(tokens.item()) != expected:
            raise RuntimeError(
                f"evaluation read {int(tokens.item())} target tokens, expected {expected}"
            )
        return float(loss_sum.item())

    @torch.no_grad()
    def _eval_forward(self, batches: list[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's summed normalised loss (zero on pp ranks without the last stage) and
        target tokens of one evaluation round."""
        layout = self.layout
        if self.pipeline is not None:
            inputs = torch.cat([mb.inputs for mb in batches]).to(self.device)
            targets = torch.cat([mb.targets for mb in batches]).to(self.device)
            with vocab_parallel_loss(layout.tp), compute_context(layout, self.device):
                loss = local_loss(self.pipeline.evaluate(inputs, targets))
            return loss.detach(), count_tokens(targets)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        for mb in batches:
            inputs, targets = mb.inputs.to(self.device), mb.targets.to(self.device)
            with vocab_parallel_loss(layout.tp), compute_context(layout, self.device):
                loss_sum += self._micro_batch_loss(self.model(inputs), targets).detach()
            tokens += count_tokens(targets)
        return loss_sum, tokens

    def _injects(self, step: int, where: str) -> bool:
        return self.inject is not None and self.inject.applies(step, self.rank, where)

    def _poison_gradients(self, exact_grads: list[torch.Tensor] | None) -> None:
        """Testing aid (trainer.fault_injection): one of this rank's gradients turns +inf."""
        grads = exact_grads or [p.grad for p in self.model.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        next(g for g in local if g.numel()).fill_(math.inf)

    def _forward_backward(self, batches: list) -> tuple[float, int, dict]:
        """The step's loss, target tokens and pipeline measurements; gradients left in place."""
        layout = self.layout
        bubble: dict = {}
        if self.pipeline is not None:
            loss_sum, tokens, bubble = self._pipeline_forward_backward(batches)
        else:
            loss_sum = torch.zeros((), device=self.device)
            tokens = torch.zeros((), dtype=torch.int64, device=self.device)
            for mb in batches:
                inputs, targets = mb.inputs.to(self.device), mb.targets.to(self.device)
                if self.router_aux is not None:
                    self._open_aux(targets)
                with vocab_parallel_loss(layout.tp):
                    with compute_context(layout, self.device):
                        loss = self._micro_batch_loss(self.model(inputs), targets)
                    loss.backward()
                loss_sum += loss.detach()
                if self.router_aux is not None:
                    # The reported loss is the objective: cross-entropy + balancing loss.
                    aux = self.router_aux.end()
                    loss_sum += aux
                    self._aux_sum += aux
                tokens += count_tokens(targets)
        if self.dp_group is not None:
            reduced = torch.stack([loss_sum, tokens.to(loss_sum.dtype)])
            dist.all_reduce(reduced, group=self.dp_group)
            loss_sum, counted = reduced[0], int(reduced[1].item())
        else:
            counted = int(tokens.item())
        if self.pp_group is not None:
            # Only the last stage's rank holds the loss; rank 0 (stage 0) reports it.
            dist.all_reduce(loss_sum, group=self.pp_group)
        return float(loss_sum.item()), counted, bubble

    def _exact_forward_backward(
        self, batches: list
    ) -> tuple[float, int, list[torch.Tensor], dict]:
        """parallel.reproducible: the step's loss and target tokens, this rank's shards of
        the exactly summed gradients (also handed to the optimizer), and the moe family's
        expert statistics.

        The loss is the exactly rounded sum (math.fsum) of the micro-batch losses, each put in
        the slot of its global micro-batch index m * dp + dp_rank, so no sum depends on dp; a
        moe model's balancing loss of each micro-batch gets a slot of its own, n + that index.
        """
        assert self.exact is not None
        layout = self.layout
        exponents = None
        n = layout.dp * layout.grad_accum
        for _attempt in range(2):
            self.exact.begin(exponents)
            if self.router_aux is not None:
                self.router_aux.take_loads()  # a retried step counts its loads once
            slots = torch.zeros(2 * n + 1, dtype=torch.float64)
            for m, mb in enumerate(batches):
                inputs, targets = mb.inputs.to(self.device), mb.targets.to(self.device)
                if self.router_aux is not None:
                    self._open_aux(targets)
                with compute_context(layout, self.device):
                    loss = self._micro_batch_loss(self.model(inputs), targets)
                loss.backward()
                self.exact.micro_batch_done()
                slots[m * layout.dp + self.dp_rank] = loss.item()
                if self.router_aux is not None:
                    slots[n + m * layout.dp + self.dp_rank] = self.router_aux.end().item()
                slots[-1] += int(count_tokens(targets))
            exponents = self.exact.settle()
            if exponents is None:
                break
            # A gradient left the range agreed from micro-batch 0: run the step again with the
            # range of the step's maxima (the same decision on every rank).
            self.exact.retries += 1
        else:
            raise RuntimeError(
                "parallel.reproducible: a step's gradients changed between two runs of it "
                "(non-deterministic kernels?)"
            )
        values = exact_slot_sum(slots, self.dp_group)
        shards = self.exact.reduce()
        place_gradients(self.exact.params, shards, self.optimizer)
        stats = ({} if self.router_aux is None else
                 self._expert_stats(torch.zeros((), device=self.device), math.fsum(values[n:-1])))
        return math.fsum(values[:-1]), int(values[-1]), shards, stats

    def _pipeline_forward_backward(
        self, batches: list
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The step's micro-batches through the schedule, as one batch it splits back in order."""
        inputs = torch.cat([mb.inputs for mb in batches]).to(self.device)
        targets = torch.cat([mb.targets for mb in batches]).to(self.device)
        if self.router_aux is not None:
            # The whole step's weights; each stage forward selects its micro-batch's rows.
            self._open_aux(targets, rows=self.layout.micro_batch)
        # The schedule runs the loss and its backward inside step(): one context around both.
        with vocab_parallel_loss(self.layout.tp), compute_context(self.layout, self.device):
            loss_sum, timing = self.pipeline.step(inputs, targets)
        loss_sum = local_loss(loss_sum)
        if self.router_aux is not None:
            # This rank's stages' share; summed with the others' over pp (and dp) by the caller.
            aux = self.router_aux.end().to(loss_sum.device)
            loss_sum = loss_sum + aux
            self._aux_sum += aux
        ratios = torch.zeros(self.layout.pp, dtype=torch.float64)
        ratios[dist.get_rank(self.pp_group)] = timing.bubble
        dist.all_reduce(ratios, group=self.pp_group)
        bubble = {
            "bubble_ratio_measured": timing.bubble,
            "bubble_ratio_predicted": predicted_bubble(self.layout),
            "bubble_ratio_pp_ranks": tuple(ratios.tolist()),
        }
        return loss_sum, count_tokens(targets), bubble

    def _clip_gradients(
        self, max_norm: float, exact_grads: list[torch.Tensor] | None = None
    ) -> float:
        """Clip by the norm of the whole model's gradient, across every mesh dimension.

        DTensor gradients reduce their norm over the dims they are sharded on; pipeline stages
        are disjoint plain sets of parameters, so their squared norms are summed over pp here
        (a per-stage clip_grad_norm_ would clip each stage by its own, smaller norm).
        `exact_grads` (parallel.reproducible): this rank's gradient shards, whose sum of
        squares is exact, so the norm does not depend on how they are sharded.
        """
        if exact_grads is not None:
            assert self.exact is not None
            grads = exact_grads
            squared = exact_squared_norm(grads, self.dp_group, self.exact.numel)
            norm = torch.tensor(math.sqrt(squared), dtype=torch.float32, device=self.device)
        else:
            if isinstance(self.optimizer, ShardedAdamW):
                # ZeRO-1: clip the reduce-scattered gradient slices the optimizer will apply.
                grads = self.optimizer.reduce_gradients()
                if self.layout.ep > 1:
                    # Expert slices live on another mesh (edp x ep) than the others (dp).
                    squared = grad_norm.squared_norm(grads)
                    norm = squared.sqrt() if squared is not None else _total_norm(grads)
                else:
                    norm = _total_norm(grads)
            else:
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                squared = grad_norm.squared_norm(grads)  # no DTensor op: fast in a new world
                norm = squared.sqrt() if squared is not None else _total_norm(grads)
            if self.pp_group is not None:
                squared_norm = norm**2
                dist.all_reduce(squared_norm, group=self.pp_group)
                norm = squared_norm.sqrt()
        # As clip_grads_with_norm_, on gradients that need not be attached to parameters.
        coef = torch.clamp((max_norm if max_norm > 0 else math.inf) / (norm + 1e-6), max=1.0)
        grad_norm.scale_(grads, coef)
        return float(norm.item())

    def full_state(self) -> dict[str, torch.Tensor]:
        """Unsharded model parameters and persistent buffers (a collective under a mesh): what
        a checkpoint's model state holds, for tests against one process."""
        out = {}
        for name, p in self.model.named_parameters():
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for prefix, module in self.model.named_modules():
            for name, b in module.named_buffers(prefix=prefix, recurse=False):
                if name.rsplit(".", 1)[-1] not in module._non_persistent_buffers_set:
                    out[name] = b.detach().cpu().clone()
        return out
