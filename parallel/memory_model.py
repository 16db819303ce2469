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

from parallel.job import ModelConfig
from parallel.layout import Layout

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


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a Llama (`trainer/model.py`), by where they live."""

    per_layer: int  # one decoder layer: attention, MLP and its two RMSNorm weights
    per_layer_norms: int  # the part of `per_layer` that TP replicates instead of sharding
    embedding: int
    head: int  # 0 when tied to the embedding
    final_norm: int
    num_layers: int

    @property
    def total(self) -> int:
        return self.per_layer * self.num_layers + self.embedding + self.head + self.final_norm


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


def llama_param_counts(model: ModelConfig) -> ParamCounts:
    """Parameter counts of `trainer/model.py`'s Llama (no biases; GQA; SwiGLU MLP).

    The playbook's generic count, h·v + L·(12h² + 13h) + 2h ("Memory usage in Transformers"),
    assumes a 4h GELU MLP with biases; a Llama layer has q and o of h × h, k and v of
    h × (kv_heads · head_dim), three h × intermediate MLP matrices and two norm weights.
    """
    h, i = model.hidden_size, model.intermediate_size
    q_dim = model.num_attention_heads * model.head_dim
    kv_dim = model.num_key_value_heads * model.head_dim
    norms = 2 * h
    per_layer = 2 * h * q_dim + 2 * h * kv_dim + 3 * h * i + norms
    embedding = model.vocab_size * h
    return ParamCounts(
        per_layer=per_layer,
        per_layer_norms=norms,
        embedding=embedding,
        head=0 if model.tie_word_embeddings else embedding,
        final_norm=h,
        num_layers=model.num_hidden_layers,
    )


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


def layer_activation_bytes(
    model: ModelConfig, layout: Layout, seq_len: int, recompute: str | None = None
) -> int:
    """One layer's activations for one micro-batch on one device of `layout`.

    Table 2 (see `korthikanti_layer_bytes`) on this device's share of the sequence: context
    parallelism gives each rank seq/cp queries, which still attend to all seq keys over the
    ring, so the s·b·h terms shrink by cp and so does the score term a·s²·b (playbook,
    "Context Parallelism"). Table 2 counts 16-bit activations; fp32 training doubles it.
    """
    mode = layout.recompute if recompute is None else recompute
    per_16bit = korthikanti_layer_bytes(
        seq_len // layout.cp, layout.micro_batch, model.hidden_size, model.num_attention_heads,
        layout.tp, layout.sequence_parallel, mode, kv_seq=seq_len,
    )
    return per_16bit * DTYPE_BYTES[layout.mixed_precision] // 2


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
    """Predicted peak bytes on a device of pipeline rank `pp_rank`.

    Model state: this rank's parameters (its layers, plus the embedding on the first stage and
    norm and head on the last, matrices split over tp, norms replicated) through
    `zero_state_bytes` over dp. `fp32_grad_accum` defaults to what `parallel/mixed_precision.py`
    does: bf16 gradients are reduced and accumulated in fp32.

    Activations: one layer's bytes × this rank's layers × its in-flight micro-batches; with
    full recompute one layer's un-recomputed activations are live again while its backward
    runs. The last stage also holds one micro-batch of logits (vocabulary split over tp) and
    the fp32 log-probabilities the loss keeps (`ops/loss.py` upcasts); all-forward-all-backward
    holds them for every micro-batch.
    """
    counts = llama_param_counts(model)
    tp, stages = layout.tp, _rank_stages(layout, pp_rank)
    last_stage = layout.pp * layout.virtual_stages - 1
    layers = model.num_hidden_layers // layout.pp
    sharded_per_layer = counts.per_layer - counts.per_layer_norms
    params = layers * (-(-sharded_per_layer // tp) + counts.per_layer_norms)
    if 0 in stages:
        params += -(-counts.embedding // tp)
    if last_stage in stages:
        params += -(-counts.head // tp) + counts.final_norm
    accum = layout.mixed_precision == "bf16" if fp32_grad_accum is None else fp32_grad_accum
    state = zero_state_bytes(
        params, state_bytes_per_param(layout.mixed_precision, accum), layout.zero, layout.dp
    )
    in_flight = in_flight_microbatches(
        layout.pp_schedule, layout.pp, layout.grad_accum, layout.virtual_stages, pp_rank
    )
    activations = math.ceil(layer_activation_bytes(model, layout, seq_len) * layers * in_flight)
    if layout.recompute == "full":
        activations += layer_activation_bytes(model, layout, seq_len, recompute="none")
    if last_stage in stages:
        # All-forward-all-backward keeps every micro-batch's loss inputs until its backward.
        logit_batches = layout.grad_accum if layout.pp > 1 and layout.pp_schedule == "gpipe" else 1
        tokens = layout.micro_batch * (seq_len // layout.cp) * logit_batches
        vocab = -(-model.vocab_size // tp)
        activations += tokens * vocab * (DTYPE_BYTES[layout.mixed_precision] + 4)
    return MemoryBreakdown(state.params, state.grads, state.optimizer, activations)


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
