"""Predicted compute, communication and time of one training step of a layout.

Pure (no torch, no I/O), like `parallel/memory_model.py`. Every formula names the playbook
section it follows; docs/planner.md explains how they combine into a step time and where the
model is deliberately simple. Communication volumes are bytes sent per device per step, with
ring collectives: an all-gather or a reduce-scatter over n ranks sends (n - 1)/n of the full
tensor per rank, an all-reduce twice that (playbook appendix, "Parallel programming crash
course", ring all-reduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models import get_spec
from models.moe.config import moe_layers
from parallel.job import ModelConfig
from parallel.layout import Layout, predicted_bubble
from parallel.memory_model import DTYPE_BYTES, param_counts


@dataclass(frozen=True)
class Hardware:
    """What a device sustains. Defaults: an H100/H200-class GPU in an 8-GPU NVLink node.

    Only ratios matter to the search (which layout is fastest), not the absolute seconds.
    """

    peak_flops_bf16: float = 989e12  # dense bf16 matmul peak
    peak_flops_fp32: float = 67e12  # dense fp32 (no TF32)
    efficiency: float = 0.5  # fraction of peak a well-fed training step reaches (MFU)
    intra_node_bytes_per_s: float = 450e9  # NVLink, per device and direction
    inter_node_bytes_per_s: float = 50e9  # 400 Gb/s network adapter per device

    def flops_per_s(self, mixed_precision: str) -> float:
        peak = self.peak_flops_bf16 if mixed_precision == "bf16" else self.peak_flops_fp32
        return peak * self.efficiency


@dataclass(frozen=True)
class CommVolume:
    """Bytes one device sends per step, by the dimension whose collectives send them."""

    dp: float = 0.0  # gradient reduction and ZeRO parameter gathers (over dp x cp)
    tp: float = 0.0
    pp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0  # expert parallelism's all-to-all (token copies out and back)

    @property
    def total(self) -> float:
        return self.dp + self.tp + self.pp + self.cp + self.ep


@dataclass(frozen=True)
class StepCost:
    """One step on the busiest device, in seconds unless named otherwise."""

    useful_s: float  # the global batch's model FLOPs / world / sustained FLOP/s
    compute_s: float  # forward + backward actually run, padding slots included
    recompute_s: float
    comm: CommVolume
    exposed_comm_s: float  # communication not hidden behind compute
    bubble_s: float
    step_s: float
    bubble_ratio: float  # idle fraction of the step, as `parallel.layout.predicted_bubble`

    @property
    def recompute_ratio(self) -> float:
        """Recompute time / step time, as the `ultra_recompute_ratio` metric measures it."""
        return self.recompute_s / self.step_s

    @property
    def efficiency(self) -> float:
        """Useful compute time / step time, in (0, 1]: the search's score."""
        return self.useful_s / self.step_s


def _moe_layer_count(model: ModelConfig) -> int:
    return len(moe_layers(model)) if model.family == "moe" else 0


def _matmul_params(model: ModelConfig) -> tuple[int, int]:
    """(matmul parameters of all decoder layers a token uses, of the LM head); lookups cost no
    FLOPs, routed experts outside a token's top-k (`ParamCounts.inactive`) neither."""
    counts = param_counts(model)
    layers = (counts.per_layer - counts.per_layer_norms) * counts.num_layers - counts.inactive
    return layers, model.vocab_size * model.hidden_size


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the attention core (QKᵀ, softmax·V) over all layers, from the
    model family's formula (e.g. 4·L·h·s for a Llama, models/llama/formulas.py)."""
    return get_spec(model.family).attention_flops_per_token(model, seq_len)


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N (forward 2·N, backward 4·N over the matmul weights; the
    playbook's compute estimate) plus 3× the attention forward (12·L·h·s), as `bench/mfu.py`."""
    layers, head = _matmul_params(model)
    return 6.0 * (layers + head) + 3 * attention_flops_per_token(model, seq_len)


def training_flops(model: ModelConfig, seq_len: int, tokens: int) -> float:
    """FLOPs to train on `tokens` tokens of sequences of `seq_len`: 6·N·tokens plus attention."""
    return flops_per_token(model, seq_len) * tokens


def recompute_flops_per_token(model: ModelConfig, seq_len: int, recompute: str) -> float:
    """Extra forward FLOPs per token re-run in backward (playbook, "Activation recomputation").

    full: every decoder layer's forward again (2·N_layers + attention), about a third more
    than a step without it; selective: only the attention core (QKᵀ, softmax, ·V), whose
    activations are the a·s² term of Table 2 but whose FLOPs are a small share.
    """
    if recompute == "none":
        return 0.0
    if recompute == "selective":
        return attention_flops_per_token(model, seq_len)
    if recompute == "full":
        layers, _ = _matmul_params(model)
        return 2.0 * layers + attention_flops_per_token(model, seq_len)
    raise ValueError(f"recompute must be none, selective or full (got {recompute!r})")


def bubble_ratio(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Pipeline bubble over ideal compute time (playbook, "Pipeline parallelism").

    All-forward-all-backward and 1F1B idle (p - 1) forward+backward slots out of m: (p - 1)/m;
    interleaving v stages per rank makes each slot v times shorter: (p - 1)/(v·m). As a
    fraction of the step it is r/(1 + r) (`parallel.layout.predicted_bubble`).
    """
    if pp < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"need pp, micro_batches, virtual_stages >= 1 (got {pp}, {micro_batches}, {virtual_stages})")
    return (pp - 1) / (virtual_stages * micro_batches)


def _ring(n: int) -> float:
    return (n - 1) / n


def dp_comm_bytes(
    params: int, group: int, zero: int, grad_bytes: int, param_bytes: int, micro_batches: int
) -> float:
    """Gradient reduction and parameter gathers over the data-parallel group (playbook, "Data
    Parallelism" and "ZeRO"), for this device's `params`.

    - ZeRO-0: one all-reduce of the accumulated gradients per step: 2Ψ.
    - ZeRO-1: a reduce-scatter of the gradients and an all-gather of the updated parameters:
      the same 2Ψ.
    - ZeRO-2: FSDP2 (`parallel/zero.py`) gathers the parameters for a micro-batch's forward,
      keeps them through its backward, then (its default) reshards them and reduce-scatters
      that micro-batch's gradients: 2Ψ per micro-batch, 2Ψ·m.
    - ZeRO-3: parameters gathered for forward and again for backward, gradients
      reduce-scattered, every micro-batch: 3Ψ·m.
    """
    ring = _ring(group)
    m = micro_batches
    if zero == 0:
        return 2 * ring * params * grad_bytes
    if zero == 1:
        return ring * params * (grad_bytes + param_bytes)
    if zero == 2:
        return ring * params * m * (param_bytes + grad_bytes)
    if zero == 3:
        return ring * params * m * (2 * param_bytes + grad_bytes)
    raise ValueError(f"zero must be 0, 1, 2 or 3 (got {zero})")


def tp_comm_bytes(
    tokens: int, hidden: int, tp: int, layers: int, micro_batches: int, act_bytes: int,
    full_recompute: bool = False,
) -> float:
    """Tensor parallelism's activation collectives (playbook, "Tensor Parallelism" and
    "Sequence Parallelism"): per layer and micro-batch, two all-reduces of the tokens × hidden
    activations in forward (after attention and after the MLP) and two in backward; sequence
    parallelism swaps each for an all-gather plus a reduce-scatter, the same bytes. Full
    recompute re-runs the forward ones.
    """
    per_layer = (6 if full_recompute else 4) * 2 * _ring(tp) * tokens * hidden * act_bytes
    return per_layer * layers * micro_batches


def pp_comm_bytes(
    tokens: int, hidden: int, pp: int, micro_batches: int, virtual_stages: int, act_bytes: int,
    shards: int = 1,
) -> float:
    """Point-to-point traffic of a pipeline rank (playbook, "Pipeline parallelism"): each of
    its v stages sends every micro-batch's activations forward and their gradients back,
    tokens × hidden each way, split over `shards` ranks when sequence parallelism leaves the
    residual stream sharded over tp."""
    if pp == 1:
        return 0.0
    return 2.0 * virtual_stages * micro_batches * tokens * hidden * act_bytes / shards


def cp_comm_bytes(
    tokens: int, kv_dim: int, cp: int, layers: int, micro_batches: int, act_bytes: int,
) -> float:
    """Ring attention (playbook, "Context Parallelism"): in each layer's forward every rank
    passes its K and V blocks (tokens × kv_dim each) cp - 1 times around the ring; backward
    passes K and V again and their gradients back: 6·(cp - 1) blocks per layer."""
    return 6.0 * (cp - 1) * tokens * kv_dim * act_bytes * layers * micro_batches


def ep_comm_bytes(
    tokens: int, hidden: int, top_k: int, ep: int, moe_layers: int, micro_batches: int,
    act_bytes: int,
) -> float:
    """Expert parallelism (parallel/expert_parallel.py): each MoE layer's forward sends the
    rank's tokens·k routed copies of h values to their experts' ranks and gets the outputs back,
    a share (ep - 1)/ep of them leaving the rank when routing is balanced; backward does the same
    with gradients: 4 all-to-alls of that size per MoE layer. (The per-expert counts, E int64
    values, are negligible.)"""
    if ep == 1:
        return 0.0
    return 4.0 * (ep - 1) / ep * tokens * top_k * hidden * act_bytes * moe_layers * micro_batches


def step_cost(
    model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, devices_per_node: int,
    hardware: Hardware | None = None,
) -> StepCost:
    """Predicted step of `layout` for `global_batch` samples of `seq_len` tokens.

    Compute and recomputation run at the sustained rate; TP and CP collectives sit on the
    critical path (not overlapped); pipeline sends cost bandwidth time; the bubble is
    (p - 1)/(v·m) of the pipeline's busy time; DP/ZeRO traffic is hidden behind backward
    (ZeRO-0/1: backward only; ZeRO-2/3: forward and backward) and only the excess counts.
    A collective runs at the intra-node bandwidth when every group of its dimension lies in one
    node (ranks are node-major with tp innermost, then cp, dp, pp: `parallel/mesh.py`), else
    at the inter-node bandwidth.
    """
    hw = hardware or Hardware()
    rate = hw.flops_per_s(layout.mixed_precision)
    act = DTYPE_BYTES[layout.mixed_precision]
    model_split = layout.tp * layout.pp * layout.cp
    samples = layout.micro_batch * layout.grad_accum  # per dp rank, padding included
    compute_s = flops_per_token(model, seq_len) * samples * seq_len / model_split / rate
    recompute_s = (recompute_flops_per_token(model, seq_len, layout.recompute)
                   * samples * seq_len / model_split / rate)
    useful_s = training_flops(model, seq_len, global_batch * seq_len) / layout.world_size / rate

    tokens = layout.micro_batch * (seq_len // layout.cp)
    layers = model.num_hidden_layers // layout.pp
    m = layout.grad_accum
    counts = param_counts(model)
    params = math.ceil(counts.total / (layout.tp * layout.pp))
    grad_bytes = 4  # fp32 gradients, or bf16's reduced in fp32 (`parallel/mixed_precision.py`)
    sp_share = layout.tp if layout.sequence_parallel else 1
    kv_dim = model.num_key_value_heads * model.head_dim // layout.tp
    comm = CommVolume(
        dp=dp_comm_bytes(params, layout.dp * layout.cp, layout.zero, grad_bytes, act, m),
        tp=tp_comm_bytes(tokens, model.hidden_size, layout.tp, layers, m, act,
                         layout.recompute == "full"),
        pp=pp_comm_bytes(tokens, model.hidden_size, layout.pp, m, layout.virtual_stages, act,
                         sp_share),
        cp=cp_comm_bytes(tokens, kv_dim, layout.cp, layers, m, act),
        ep=ep_comm_bytes(tokens, model.hidden_size, model.num_experts_per_tok, layout.ep,
                         _moe_layer_count(model) // layout.pp, m, act),
    )

    def bandwidth(span: int) -> float:
        """A group of `span` consecutive ranks lies inside a node when spans tile the node."""
        if devices_per_node % span == 0:
            return hw.intra_node_bytes_per_s
        return hw.inter_node_bytes_per_s

    tp_s = comm.tp / bandwidth(layout.tp)
    cp_s = comm.cp / bandwidth(layout.cp * layout.tp)
    pp_s = comm.pp / bandwidth(layout.world_size)
    dp_s = comm.dp / bandwidth(layout.dp * layout.cp * layout.tp)
    ep_s = comm.ep / bandwidth(layout.ep * layout.cp * layout.tp)  # ep is innermost in dp
    busy = compute_s + recompute_s + tp_s + cp_s + pp_s + ep_s
    bubble_s = bubble_ratio(layout.pp, m, layout.virtual_stages) * busy
    overlap = compute_s * (2 / 3 if layout.zero <= 1 else 1.0) + recompute_s
    exposed_dp = max(0.0, dp_s - overlap)
    step_s = busy + bubble_s + exposed_dp
    return StepCost(
        useful_s=useful_s, compute_s=compute_s, recompute_s=recompute_s, comm=comm,
        exposed_comm_s=tp_s + cp_s + pp_s + ep_s + exposed_dp, bubble_s=bubble_s, step_s=step_s,
        bubble_ratio=predicted_bubble(layout),
    )
