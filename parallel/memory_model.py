"""Predicted memory per device: model state per ZeRO stage, activations, pipeline in-flight work.

Pure (no torch, no I/O): the planner evaluates thousands of layouts with it. The formulas are
the playbook's (docs/planner.md explains them and where we depart from it); every function
names the playbook section it follows. Bytes are exact integers where the formula allows, and
rounded up where it divides (a shard or a 1/tp share of a tensor).

Kinds match the plan's `predicted.memory_bytes` and the `ultra_memory_bytes{kind}` metric:
params, grads, optimizer (fp32 master weights included) and activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from models import ParamCounts, ParamShape, get_spec
from parallel.job import ModelConfig
from parallel.layout import Layout

__all__ = ["ParamCounts", "ParamShape", "param_counts", "peak_memory", "rank_memory"]

DTYPE_BYTES = MappingProxyType({"fp32": 4, "bf16": 2})
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of model state, before any ZeRO sharding."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device, by kind."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def state_bytes_per_param(mixed_precision: str, fp32_grad_accum: bool = False) -> StateBytes:
    """Bytes per parameter for AdamW training (playbook, "Memory usage in Transformers").

    fp32: weights 4, gradients 4, two Adam moments 8 (16 bytes). bf16 mixed precision: bf16
    weights 2 and gradients 2, and the optimizer keeps an fp32 master copy 4 next to the
    moments 8 (16 bytes); accumulating gradients in fp32 adds an fp32 gradient copy 4
    (20 bytes). fp32 training has nothing to add, so `fp32_grad_accum` changes only bf16.
    """
    if mixed_precision == "fp32":
        return StateBytes(params=4, grads=4, optimizer=8)
    if mixed_precision == "bf16":
        return StateBytes(params=2, grads=2 + (4 if fp32_grad_accum else 0), optimizer=4 + 8)
    raise ValueError(f"mixed_precision must be one of {tuple(DTYPE_BYTES)} (got {mixed_precision!r})")


def zero_state_bytes(
    num_params: int, state: StateBytes, zero: int, dp: int
) -> MemoryBreakdown:
    """Model state on one of `dp` data-parallel ranks at ZeRO `zero` (playbook, "ZeRO").

    Stage 0 (plain DP) replicates everything; stage 1 shards the optimizer state over dp,
    stage 2 the gradients too, stage 3 the parameters too. With bf16 and k = 12 optimizer
    bytes this is the playbook's table: 2Ψ+2Ψ+12Ψ/N, 2Ψ+(2+12)Ψ/N, (2+2+12)Ψ/N. A shard holds
    ceil(Ψ/N) parameters.
    """
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES} (got {zero})")
    if dp < 1 or num_params < 0:
        raise ValueError(f"need dp >= 1 and num_params >= 0 (got {dp}, {num_params})")
    shard = -(-num_params // dp)

    def held(sharded_from: int) -> int:
        return shard if zero >= sharded_from else num_params

    return MemoryBreakdown(
        params=held(3) * state.params,
        grads=held(2) * state.grads,
        optimizer=held(1) * state.optimizer,
    )


def param_counts(model: ModelConfig) -> ParamCounts:
    """Parameter counts of the job's model, from its family's formulas (models/<family>)."""
    return get_spec(model.family).param_counts(model)


def _chunk(size: int, parts: int) -> int:
    """The largest piece of `size` split in `parts` as torch.chunk (and DTensor's Shard) does:
    the first rank's, the one this model predicts."""
    return -(-size // parts)


@dataclass(frozen=True)
class ShardedCounts:
    """Elements of each kind of model state one rank holds, and its parameter tensors."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    tensors: int = 0

    def __add__(self, other: ShardedCounts) -> ShardedCounts:
        return ShardedCounts(self.params + other.params, self.grads + other.grads,
                             self.optimizer + other.optimizer, self.tensors + other.tensors)


def sharded_counts(p: ParamShape, tp: int, zero: int, shards: int, ep: int = 1) -> ShardedCounts:
    """Elements of one parameter's state on the first rank, as this code base shards them.

    TP splits `p.tp_dim` (tp > 1). ZeRO-2/3 are FSDP2 (`parallel/zero.py`), which shards dim 0
    of the TP-local tensor into padded chunks and holds parameters, gradients and optimizer
    state as those shards (ZeRO-2 gathers parameters once per step, but keeps only the shards at
    rest). ZeRO-1 keeps the TP-local parameter and gradient whole, and its optimizer state on a
    slice of the first dim TP leaves whole (dim 0 when tp = 1); the gradient is whole as
    autograd made it (`ParamShape.whole_grad`) until ZeRO-1's reduce-scatter.
    Expert parallelism (ep > 1) splits `p.ep_dim` of a routed-expert tensor over ep; ZeRO then
    shards it over the shards / ep ranks holding the same experts (`parallel/expert_parallel.py`).
    """
    local = list(p.shape)
    if tp > 1 and p.tp_dim is not None:
        local[p.tp_dim] = _chunk(local[p.tp_dim], tp)
    split: int | None = p.tp_dim if tp > 1 else None
    if ep > 1 and p.ep_dim is not None:
        local[p.ep_dim] = _chunk(local[p.ep_dim], ep)
        shards, split = shards // ep, p.ep_dim
    whole = math.prod(local)
    if zero >= 2:
        shard = _chunk(local[0], shards) * whole // local[0]
        return ShardedCounts(shard, shard, shard, 1)
    dim = next(d for d in range(len(local)) if d != split)
    piece = _chunk(local[dim], shards) * whole // local[dim]
    grad = math.prod(p.shape) if p.whole_grad and tp > 1 else whole
    return ShardedCounts(whole, grad, piece if zero == 1 else whole, 1)


def korthikanti_layer_bytes(
    seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
    sequence_parallel: bool = False, recompute: str = "none", kv_seq: int | None = None,
) -> int:
    """Activation bytes one transformer layer keeps for backward, 16-bit activations.

    Korthikanti et al. 2022, Table 2, which the playbook uses ("Memory usage in Transformers",
    activations; "Activation recomputation"; "Tensor Parallelism"; "Sequence Parallelism"),
    with s = seq, b = micro_batch, h = hidden, a = heads, t = tp:

        no recompute, no TP       sbh(34 + 5as/h)
        TP                        sbh(10 + 24/t + 5as/(ht))
        TP + SP                   sbh(34/t + 5as/(ht))
        selective (attention core recomputed): the 5as/h terms vanish
        full (only the layer input kept)        2sbh, and 2sbh/t when SP shards it

    t = 1 makes the TP rows the first one. `kv_seq` (default s) is the number of keys each
    query attends to, for context parallelism: the score term is 5·a·s·kv_seq·b. Rounded up to
    whole bytes.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full (got {recompute!r})")
    sbh = seq * micro_batch * hidden
    sp = sequence_parallel and tp > 1
    if recompute == "full":
        return -(-2 * sbh // tp) if sp else 2 * sbh
    keys = seq if kv_seq is None else kv_seq
    scores = 0 if recompute == "selective" else 5 * heads * seq * keys * micro_batch
    # Exact integer arithmetic over the common denominator t, then one rounding.
    numerator = 34 * sbh + scores if sp else 10 * sbh * tp + 24 * sbh + scores
    return -(-numerator // tp)


def _div(numerator: int, tp: int) -> int:
    return -(-numerator // tp)


def _norm_bytes(tokens: int, hidden: int, dtype: int, tp: int, sp: bool) -> int:
    """What an RMSNorm (`ops/norm.py`) and the matmul after it keep: the fp32 input and the
    per-token rsqrt (for the norm's own backward), the normalised input (for its weight's
    gradient), and the scaled output the projection saves; with SP the first three are on 1/tp
    of the sequence and the projection saves the all-gathered output."""
    th = tokens * hidden
    sharded = th * 4 + tokens * 4 + th * dtype
    return (_div(sharded, tp) if sp else sharded) + th * dtype


def layer_activation_bytes(
    model: ModelConfig, layout: Layout, seq_len: int, recompute: str | None = None
) -> int:
    """One layer's saved activations for one micro-batch on one device of `layout`.

    What autograd saves for a Llama-architecture block (models/llama/model.py; counted with
    saved-tensor hooks by `trainer/memory_meter.py`), with T = b·s/cp tokens, t = tp and c bytes per compute element:

    - two norms (`_norm_bytes`): 6Tc·h + 8T without SP;
    - attention: RoPE'd q, k and v repeated to all a heads (GQA), and the output (4T·a·d/t
      elements), plus the fp32 log-sum-exp per head (4T·a/t bytes) of SDPA/flash attention,
      which never stores the s² scores (unlike Korthikanti et al.'s table, see
      `korthikanti_layer_bytes`; playbook, "Memory usage in Transformers");
    - MLP: gate and up outputs, SiLU(gate) and the product (4T·i/t elements);
    - RoPE rows a layer selects for itself (context parallelism's global positions, or a cast to
      bf16): 4·(s/cp)·d elements; otherwise the shared fp32 tables, counted once per rank.

    Selective recompute (`parallel/recompute.py`) keeps the block input and the matmul outputs
    (q, k, v, o, gate, up, down); full recompute keeps the block input only; 1/tp of it with SP.
    """
    mode = layout.recompute if recompute is None else recompute
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full (got {mode!r})")
    c, t, h = DTYPE_BYTES[layout.mixed_precision], layout.tp, model.hidden_size
    sp = layout.sequence_parallel and t > 1
    tokens = layout.micro_batch * (seq_len // layout.cp)
    q_dim = model.num_attention_heads * model.head_dim
    kv_dim = model.num_key_value_heads * model.head_dim
    i = model.intermediate_size
    block_input = _div(tokens * h * c, t) if sp else tokens * h * c
    if mode == "full":
        return block_input
    if mode == "selective":
        projections = _div(tokens * (q_dim + 2 * kv_dim + 2 * i) * c, t)
        return block_input + projections + 2 * tokens * h * c
    norms = 2 * _norm_bytes(tokens, h, c, t, sp)
    attention = _div(4 * tokens * q_dim * c + tokens * model.num_attention_heads * 4, t)
    mlp = _div(4 * tokens * i * c, t)
    rope = 4 * (seq_len // layout.cp) * model.head_dim * c if layout.cp > 1 or c != 4 else 0
    return norms + attention + mlp + rope


def in_flight_microbatches(
    schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1, pp_rank: int = 0
) -> float:
    """Micro-batches whose activations pp rank `pp_rank` holds at its peak, in units of all of
    its layers (playbook, "Pipeline parallelism").

    - pp = 1: gradient accumulation finishes each micro-batch's backward before the next
      forward: 1.
    - gpipe (all-forward-all-backward): every micro-batch, m.
    - 1f1b: rank r runs p - r warm-up forwards before its first backward: min(p - r, m).
    - interleaved_1f1b: rank r warms up with 2(p - r - 1) + (v - 1)p + 1 chunks of 1/v of its
      layers, i.e. ((v + 1)p - 2r - 1)/v; rank 0's p + (p - 1)/v is Korthikanti et al.'s
      (1 + (p - 1)/(pv)) factor over 1F1B. At most m.
    - zero_bubble: ZB-H1 and ZB-V keep 1F1B's peak, min(p, m) on rank 0 (Qi et al. 2023,
      the playbook's "Zero Bubble and DualPipe" section); we use 1F1B's per-rank count.
    """
    if pp == 1:
        return 1.0
    m, p, v, r = micro_batches, pp, virtual_stages, pp_rank
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zero_bubble"):
        return float(min(p - r, m))
    if schedule == "interleaved_1f1b":
        return min(((v + 1) * p - 2 * r - 1) / v, float(m))
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _rank_stages(layout: Layout, pp_rank: int) -> tuple[int, ...]:
    """Stages of `pp_rank`, as `parallel/pipeline.py` places them (loop, or V for ZB-V)."""
    p, v = layout.pp, layout.virtual_stages
    if layout.pp_schedule == "zero_bubble" and v == 2:
        return tuple(sorted({pp_rank, 2 * p - 1 - pp_rank}))
    return tuple(pp_rank + i * p for i in range(v))


def rank_memory(
    model: ModelConfig, layout: Layout, seq_len: int, pp_rank: int,
    fp32_grad_accum: bool | None = None,
) -> MemoryBreakdown:
    """Predicted peak bytes on the first device of pipeline rank `pp_rank` (its first dp, cp
    and tp rank, which holds the largest shards when they are uneven).

    Model state: each of this rank's parameter tensors (its layers, plus the embedding on the
    first stage and norm and head on the last) sharded as the code does it (`sharded_counts`:
    TP, then ZeRO over dp × cp, the `dp_cp` mesh dim), times the playbook's bytes per element
    of each kind (`state_bytes_per_param`; exact for fp32), plus AdamW's fp32 step counter per
    tensor. `fp32_grad_accum` defaults to what `parallel/mixed_precision.py` does: bf16
    gradients are reduced and accumulated in fp32.

    Activations: one layer's bytes × this rank's layers × its in-flight micro-batches; with
    full recompute one layer's un-recomputed activations are live again while its backward
    runs. The first stage also keeps the token ids the embedding saves, the last the final norm,
    the fp32 log-probabilities the loss keeps (vocabulary split over tp; `ops/loss.py`
    upcasts), the targets, for each micro-batch whose loss is in flight; with pp > 1 the
    step's ids and targets are one tensor the micro-batches are views of.
    """
    shapes = get_spec(model.family).param_shapes(model)
    tp, stages = layout.tp, _rank_stages(layout, pp_rank)
    last_stage = layout.pp * layout.virtual_stages - 1
    layers = model.num_hidden_layers // layout.pp
    held = [*shapes["layer"]] * layers
    if 0 in stages:
        held += shapes["embedding"]
    if last_stage in stages:
        held += [*shapes["final_norm"], *shapes["head"]]
    counts = sum((sharded_counts(p, tp, layout.zero, layout.dp * layout.cp, layout.ep)
                  for p in held),
                 ShardedCounts())
    accum = layout.mixed_precision == "bf16" if fp32_grad_accum is None else fp32_grad_accum
    state = state_bytes_per_param(layout.mixed_precision, accum)
    in_flight = in_flight_microbatches(
        layout.pp_schedule, layout.pp, layout.grad_accum, layout.virtual_stages, pp_rank
    )
    activations = math.ceil(layer_activation_bytes(model, layout, seq_len) * layers * in_flight)
    if layout.recompute == "full":
        activations += layer_activation_bytes(model, layout, seq_len, recompute="none")
    c = DTYPE_BYTES[layout.mixed_precision]
    if c == 4 and layout.cp == 1 and layers:
        activations += 2 * model.max_position_embeddings * model.head_dim * 4  # RoPE tables
    tokens = layout.micro_batch * (seq_len // layout.cp)
    ids = tokens * 8 * (layout.grad_accum if layout.pp > 1 else 1)  # int64
    if 0 in stages:
        activations += ids
    if last_stage in stages:
        # All-forward-all-backward keeps every micro-batch's loss inputs until its backward.
        logit_batches = layout.grad_accum if layout.pp > 1 and layout.pp_schedule == "gpipe" else 1
        sp = layout.sequence_parallel and tp > 1
        loss = _div(tokens * model.vocab_size, tp) * 4 + 4  # log-probs, the loss's weight sum
        final_norm = _norm_bytes(tokens, model.hidden_size, c, tp, sp)
        activations += (final_norm + loss) * logit_batches + ids
    return MemoryBreakdown(
        params=counts.params * state.params,
        grads=counts.grads * state.grads,
        optimizer=counts.optimizer * state.optimizer + counts.tensors * 4,
        activations=activations,
    )


def peak_memory(
    model: ModelConfig, layout: Layout, seq_len: int, fp32_grad_accum: bool | None = None
) -> MemoryBreakdown:
    """The breakdown of the pipeline rank with the largest predicted total.

    Only the first and the last pp rank can be it: the first holds the embedding and the most
    in-flight micro-batches, the last the head and the logits; the ones between hold less.
    """
    ranks = sorted({0, layout.pp - 1})
    per_rank = [rank_memory(model, layout, seq_len, r, fp32_grad_accum) for r in ranks]
    return max(per_rank, key=lambda m: m.total)
