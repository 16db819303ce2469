"""The layout of one generation: how a job is spread over a world of devices.

Pure: the agent resolves layouts without torch. `Layout` is what a generation plan carries
(docs/architecture.md, "The plan"); `resolve` fills `dp` and `grad_accum` for a world size.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from parallel import mesh_dims
from parallel.job import ConfigError, JobConfig

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
RECOMPUTE = ("none", "selective", "full")

@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # Expert parallelism: a factor of dp (the ep ranks are data-parallel for everything but
    # the routed experts, which they split); parallel.expert_parallel.
    ep: int = 1
    zero: int = 3
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    micro_batch: int = 1
    grad_accum: int = 1
    mixed_precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in (*mesh_dims.NAMES, "virtual_stages", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"layout.{name} must be >= 1 (got {getattr(self, name)})")
        problem = mesh_dims.nesting_problem(mesh_dims.sizes(self))
        if problem:
            raise ConfigError(problem)
        if self.zero not in (1, 2, 3):
            raise ConfigError(f"layout.zero must be 1, 2 or 3 (got {self.zero})")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(
                f"layout.pp_schedule must be one of {PP_SCHEDULES} (got {self.pp_schedule!r})"
            )
        if self.recompute not in RECOMPUTE:
            raise ConfigError(
                f"layout.recompute must be one of {RECOMPUTE} (got {self.recompute!r})"
            )
        if self.mixed_precision not in ("fp32", "bf16"):
            raise ConfigError(
                f"layout.mixed_precision must be fp32 or bf16 (got {self.mixed_precision!r})"
            )

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, name) for name in mesh_dims.DEVICE_DIMS)

    @property
    def samples_per_step(self) -> int:
        """Sample slots per step, including zero-weight padding slots."""
        return self.dp * self.micro_batch * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Layout:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"unknown layout field(s): {', '.join(sorted(unknown))}")
        return cls(**raw)


def resolve(job: JobConfig, world_size: int, devices_per_node: int | None = None) -> Layout:
    """The layout of `job` on `world_size` devices, checked against the model and batch.

    `devices_per_node` (known to the agent, not to a worker) also checks that a TP group fits
    in one node: TP all-reduces every layer, which only intra-node links sustain.
    """
    p, m, t = job.parallel, job.model, job.train
    if devices_per_node is not None and devices_per_node % p.tp:
        raise ConfigError(
            f"parallel.tp must divide the devices per node, so a TP group stays inside a node "
            f"(got tp {p.tp}, {devices_per_node} devices per node)"
        )
    inner = p.tp * p.pp * p.cp
    if world_size % inner:
        raise ConfigError(
            f"parallel.tp x pp x cp = {inner} must divide the number of devices ({world_size})"
        )
    dp = world_size // inner if p.dp == "auto" else p.dp
    if dp * inner != world_size:
        raise ConfigError(
            f"parallel.dp x tp x pp x cp must equal the number of devices "
            f"(got {dp} x {p.tp} x {p.pp} x {p.cp} = {dp * inner}, devices {world_size})"
        )
    if p.pad_uneven:
        if dp > t.global_batch:
            raise ConfigError(
                f"parallel.dp must be <= train.global_batch, or some ranks would see no sample "
                f"(got {dp}, {t.global_batch})"
            )
    elif t.global_batch % (dp * p.micro_batch):
        raise ConfigError(
            f"train.global_batch must be a multiple of parallel.dp x parallel.micro_batch when "
            f"parallel.pad_uneven is false (got {t.global_batch}, {dp} x {p.micro_batch})"
        )
    if m.num_attention_heads % p.tp or m.num_key_value_heads % p.tp:
        raise ConfigError(
            f"parallel.tp must divide model.num_attention_heads and model.num_key_value_heads "
            f"(got {p.tp}, {m.num_attention_heads}, {m.num_key_value_heads})"
        )
    if m.num_hidden_layers % (p.pp * p.virtual_stages):
        raise ConfigError(
            f"parallel.pp x parallel.virtual_stages must divide model.num_hidden_layers "
            f"(got {p.pp} x {p.virtual_stages}, {m.num_hidden_layers})"
        )
    if p.tp > 1 and m.tie_word_embeddings:
        raise ConfigError(
            "model.tie_word_embeddings needs parallel.tp = 1: the vocab-parallel embedding and "
            f"head shard the shared matrix on different dims (got tp {p.tp})"
        )
    if p.pp > 1 and m.tie_word_embeddings:
        raise ConfigError(
            "model.tie_word_embeddings needs parallel.pp = 1: the embedding and the head live on "
            f"different pipeline stages (got pp {p.pp})"
        )
    if t.seq_len % (2 * p.cp) and p.cp > 1:
        raise ConfigError(
            f"train.seq_len must be a multiple of 2 x parallel.cp for zig-zag context parallelism "
            f"(got {t.seq_len}, cp {p.cp})"
        )
    if p.reproducible and (p.tp, p.pp, p.cp) != (1, 1, 1):
        raise ConfigError(
            f"parallel.reproducible covers data parallelism and ZeRO only: parallel.tp, pp and cp "
            f"must be 1 (got tp {p.tp}, pp {p.pp}, cp {p.cp}); see docs/reproducible.md"
        )
    check_experts(job, dp)
    grad_accum = math.ceil(t.global_batch / (dp * p.micro_batch))
    layout = Layout(
        dp=dp,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        zero=p.zero,
        sequence_parallel=p.sequence_parallel,
        pp_schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages,
        recompute=p.recompute,
        micro_batch=p.micro_batch,
        grad_accum=grad_accum,
        mixed_precision=p.mixed_precision,
    )
    check_supported(layout)
    return layout


def check_experts(job: JobConfig, dp: int) -> None:
    """Expert parallelism and the moe family against the rest of the layout: what is not
    built yet is refused here, naming the field (docs/moe.md, "What does not work yet")."""
    p, m = job.parallel, job.model
    if p.ep > 1 and m.family != "moe":
        raise ConfigError(f"parallel.ep > 1 needs model.family = \"moe\" (got ep {p.ep}, "
                          f"family {m.family!r})")
    problem = mesh_dims.nesting_problem(mesh_dims.sizes(dataclasses.replace(p, dp=dp)))
    if problem:
        raise ConfigError(problem)
    if m.family != "moe":
        return
    if m.num_experts % p.ep:
        raise ConfigError(f"parallel.ep must divide model.num_experts (got ep {p.ep}, "
                          f"{m.num_experts} experts)")
    if p.cp > 1 and (p.tp > 1 or p.pp > 1):
        # cp with dp, ep and ZeRO is tested against one process; with tp or pp it is not yet.
        raise ConfigError(f"model.family \"moe\" with parallel.cp > 1 needs parallel.tp = 1 "
                          f"and parallel.pp = 1 for now (got cp {p.cp}, tp {p.tp}, pp {p.pp}); "
                          "see docs/moe.md")
    if p.tp > 1 and p.sequence_parallel:
        raise ConfigError("model.family \"moe\" does not support parallel.sequence_parallel "
                          "yet (its MoE layers are replicated over tp); see docs/moe.md")
    if p.pp > 1 and p.pp_schedule == "zero_bubble":
        raise ConfigError("model.family \"moe\" does not support parallel.pp_schedule = "
                          "\"zero_bubble\" yet (its split backward is untested with routed experts)")
    if p.recompute == "full":
        raise ConfigError("model.family \"moe\" does not support parallel.recompute = \"full\" "
                          "yet: a recomputed forward would count the balancing loss twice")


def check_supported(layout: Layout) -> None:
    """Reject what the workers cannot apply yet, so a plan never names an impossible layout."""
    check_pipeline(layout)


def check_pipeline(layout: Layout) -> None:
    """Pipeline schedule constraints (torch.distributed.pipelining's), each error naming it."""
    p, v, m, sched = layout.pp, layout.virtual_stages, layout.grad_accum, layout.pp_schedule
    if p == 1:
        if v != 1:
            raise ConfigError(f"parallel.virtual_stages > 1 needs parallel.pp > 1 (got {v})")
        return
    if sched in ("gpipe", "1f1b") and v != 1:
        raise ConfigError(
            f"parallel.pp_schedule = {sched!r} runs one stage per rank: parallel.virtual_stages "
            f"must be 1 (got {v}); use 'interleaved_1f1b' or 'zero_bubble' for virtual stages"
        )
    if sched == "interleaved_1f1b" and v < 2:
        raise ConfigError(
            f"parallel.pp_schedule = 'interleaved_1f1b' needs parallel.virtual_stages >= 2 (got {v})"
        )
    if sched == "zero_bubble" and v > 2:
        raise ConfigError(
            f"parallel.pp_schedule = 'zero_bubble' supports parallel.virtual_stages 1 (ZB-H1) or "
            f"2 (ZB-V) (got {v})"
        )
    if sched == "zero_bubble" and layout.zero == 3:
        raise ConfigError(
            "parallel.pp_schedule = 'zero_bubble' needs parallel.zero <= 2: its split backward "
            "finds the weights through the stage's registered parameters, which ZeRO-3 has "
            "resharded after forward, so weight gradients would go astray (torch 2.13)"
        )
    if sched == "1f1b" and m < p:
        raise ConfigError(
            f"parallel.pp_schedule = '1f1b' needs at least parallel.pp micro-batches per step: "
            f"grad_accum = ceil(global_batch / (dp x micro_batch)) = {m} < pp = {p}"
        )
    if sched == "interleaved_1f1b" or (sched == "zero_bubble" and v == 1):
        rounds = max(1, m // p)
        if m % rounds:
            raise ConfigError(
                f"parallel.pp_schedule = {sched!r} needs the micro-batches per step "
                f"(grad_accum = {m}) to be a multiple of max(1, grad_accum // pp) = {rounds}"
            )


def predicted_bubble(layout: Layout) -> float:
    """Idle fraction of a step from the playbook's r = (p - 1) / (v * m) (bubble / ideal time)."""
    r = (layout.pp - 1) / (layout.virtual_stages * layout.grad_accum)
    return r / (1 + r)
