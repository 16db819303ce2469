"""The job: a TOML file parsed into frozen dataclasses, validated field by field.

Pure (no torch, no I/O beyond reading the file) so the agent can validate a submitted job spec
without importing torch. Every error names the offending field, e.g.
`train.global_batch must be >= 1 (got 0)`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NewType, Union

from models import get_spec
from models.hf_config import with_pretrained_model

# The [model] section and the spec's error live in models/model_config.py, which the families
# import; the rest of the code base imports them from the job spec.
from models.model_config import ConfigError as ConfigError
from models.model_config import ModelConfig as ModelConfig
from parallel import bounded_toml, mesh_dims

# A field naming a file or directory the workers read or write: agents refuse a spec whose
# paths lie outside the roots they allow (parallel.job_paths).
JobPath = NewType("JobPath", str)


@dataclass(frozen=True)
class InitConfig:
    """Initial weights for a job that has no checkpoint of its own (trainer/restore_order.py).

    `hf`: a Hugging Face model directory (config.json and *.safetensors); the `[model]` fields
    then come from its config.json (models/hf_config.py). Empty: random initialisation."""

    hf: JobPath = JobPath("")


@dataclass(frozen=True)
class DataSource:
    """One token file of a blend; weights are relative (docs/data.md, "Blends")."""

    path: JobPath = JobPath("")
    weight: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    """Exactly one of `path` (a prepared token file), `source` (a built-in corpus) or
    `sources` (`[[data.sources]]`: a weighted blend of token files)."""

    path: JobPath = JobPath("")
    source: str = ""
    sources: tuple[DataSource, ...] = ()
    cache_dir: JobPath = JobPath("~/.cache/ultrascale")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 16
    seq_len: int = 128
    seed: int = 1234
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # Steps skipped in a row for a non-finite loss or gradient norm that end the job `failed`
    # (trainer.nonfinite).
    max_skipped_steps: int = 5


@dataclass(frozen=True)
class ParallelConfig:
    dp: Union[int, Literal["auto"]] = "auto"  # noqa: UP007 - read by the typed parser below
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # Expert parallelism (parallel.expert_parallel): experts sharded over ep ranks taken from
    # dp, so ep must divide dp (docs/moe.md).
    ep: int = 1
    zero: Literal[1, 2, 3] = 3
    sequence_parallel: bool = False
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    virtual_stages: int = 1
    recompute: Literal["none", "selective", "full"] = "none"
    micro_batch: int = 1
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    # Uneven global batches: pad each step with zero-weight samples up to dp x micro_batch x
    # grad_accum, so every rank runs the same micro-batches and collectives.
    pad_uneven: bool = True
    # Bit-identical steps whatever dp and the ZeRO stage: exact fixed-point gradient, norm and
    # loss sums and deterministic kernels (parallel.reproducible, docs/reproducible.md).
    reproducible: bool = False
    # Dimensions (of REPLAN_DIMS) the daemon may change when the job's own layout cannot run on
    # the ready nodes or does not fit their memory (parallel.planner, docs/planner.md). Empty:
    # only dp follows the world.
    replan: tuple[str, ...] = ()


# What a layout search may choose besides dp (parallel.layout_search): the searchable mesh
# dimensions (parallel.mesh_dims), then the other knobs of a layout.
REPLAN_DIMS = (
    *mesh_dims.SEARCHABLE, "zero", "sequence_parallel", "pp_schedule", "recompute", "micro_batch",
)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: JobPath = JobPath("")
    every: int = 0
    keep: int = 2
    # In-memory snapshots (docs/snapshots.md), taken by workers an agent runs: every this many
    # steps (0: off), into the node's shared memory, replicated to a buddy node.
    snapshot_every: int = 1
    # "shared": `dir` is one filesystem every node mounts (checked at each generation's start).
    # "node": each node's `dir` is its own disk; durable checkpoints are then fragments, and
    # restores come from peer memory (docs/snapshots.md, "Node-local checkpoint directories").
    storage: str = "shared"


CHECKPOINT_STORAGE = ("shared", "node")


@dataclass(frozen=True)
class FaultConfig:
    """How failures are detected and retried; every duration is in seconds.

    The agent's watchdog applies the deadlines (a rank is hung when it misses the one of its
    phase); `process_group_timeout` derives the workers' collective timeout from them.
    """

    # No completed step for max(hang_floor_s, hang_step_factor x median recent step time):
    # the floor keeps short steps from being called hung over a scheduling hiccup.
    hang_floor_s: float = 10.0
    hang_step_factor: float = 5.0
    join_timeout_s: float = 60.0  # rendezvous + process-group init of one generation
    restore_timeout_s: float = 120.0  # build the model + restore the checkpoint
    first_step_timeout_s: float = 120.0  # the first step after a restore (warm-up, compile)
    # A worker whose heartbeat thread is silent this long is hung: stopped, or stuck holding
    # the interpreter lock.
    heartbeat_timeout_s: float = 5.0
    max_failures: int = 3  # the same cause this many times in a row ends the retries
    # Delay before re-forming after a repeated failure: backoff_s, doubled each time, capped.
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0


@dataclass(frozen=True)
class ProfileConfig:
    """torch.profiler traces of steps `steps = [first, last]` (1-based, inclusive; empty: off),
    written by the global ranks listed in `ranks` ("all": every rank) under
    `<job.output_dir>/profile/rank_<r>/` (docs/observability.md, "Profiling")."""

    steps: tuple[int, ...] = ()
    ranks: Union[tuple[int, ...], Literal["all"]] = (0,)  # noqa: UP007 - read by the parser


@dataclass(frozen=True)
class MetricsConfig:
    # TensorBoard event files of rank 0's step lines under job.output_dir/tensorboard (the
    # optional `tensorboard` extra).
    tensorboard: bool = False


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (trainer/evaluation.py, docs/data.md "Evaluation"): after every
    `every`-th step (0: off), the loss over samples 0..samples-1 of the stream of `path` or
    `sources` (a blend, as `[[data.sources]]`), built as the training stream is."""

    path: JobPath = JobPath("")
    sources: tuple[DataSource, ...] = ()
    every: int = 0
    samples: int = 0


@dataclass(frozen=True)
class JobMeta:
    name: str = "job"
    output_dir: JobPath = JobPath("")


@dataclass(frozen=True)
class JobConfig:
    job: JobMeta = field(default_factory=JobMeta)
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]

# Bounds on any value, so that nothing read from a spec is unbounded (README, "Job files").
MAX_STRING = 4096  # characters: a path's PATH_MAX
MAX_LIST = 64  # items
MAX_STEPS = 10**9
MAX_SECONDS = 86400.0  # a day: any deadline or delay
MAX_WEIGHT = 1e6  # a blend source's relative weight
MAX_RANK = 2**31 - 1  # a global rank named in a list (profile.ranks)
# The largest value of every int and float field: far beyond any real job, small enough that
# nothing derived from them (world sizes, sample counts, deadlines) overflows or runs forever.
MAX: dict[str, int | float] = {
    "model.hidden_size": 2**17, "model.intermediate_size": 2**19,
    "model.num_hidden_layers": 2**12, "model.num_attention_heads": 2**12,
    "model.num_key_value_heads": 2**12, "model.vocab_size": 2**22,
    "model.max_position_embeddings": 2**24, "model.rope_theta": 1e12, "model.rms_norm_eps": 1.0,
    "model.initializer_range": 1.0, "model.head_dim": 2**12,
    "model.num_experts": 2**12, "model.num_experts_per_tok": 2**12,
    "model.moe_intermediate_size": 2**19, "model.num_shared_experts": 2**12,
    "model.first_k_dense_replace": 2**12, "model.moe_layer_freq": 2**12,
    "model.router_aux_loss_coef": 1e3, "model.router_bias_update_rate": 1.0,
    "train.steps": MAX_STEPS, "train.global_batch": 2**24, "train.seq_len": 2**24,
    "train.seed": 2**63 - 1, "train.lr": 10.0, "train.min_lr": 10.0,
    "train.warmup_steps": MAX_STEPS, "train.weight_decay": 10.0, "train.beta1": 1.0,
    "train.beta2": 1.0, "train.eps": 1.0, "train.grad_clip": 1e9,
    "train.max_skipped_steps": MAX_STEPS,
    "parallel.dp": 2**16, "parallel.tp": 2**10, "parallel.pp": 2**10, "parallel.cp": 2**10,
    "parallel.ep": 2**12,
    "parallel.virtual_stages": 2**10, "parallel.micro_batch": 2**24,
    "checkpoint.every": MAX_STEPS, "checkpoint.keep": 1000, "checkpoint.snapshot_every": MAX_STEPS,
    "fault.hang_floor_s": MAX_SECONDS, "fault.hang_step_factor": 1000.0,
    "fault.join_timeout_s": MAX_SECONDS, "fault.restore_timeout_s": MAX_SECONDS,
    "fault.first_step_timeout_s": MAX_SECONDS, "fault.heartbeat_timeout_s": MAX_SECONDS,
    "fault.max_failures": 1000, "fault.backoff_s": MAX_SECONDS, "fault.backoff_max_s": MAX_SECONDS,
    "eval.every": MAX_STEPS, "eval.samples": 2**24,
}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def coerce(name: str, tp: Any, value: Any) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected.

    Shared by every TOML read from outside (a job spec, ultrad's --config): a bool is never an
    int, a float never an int, a string at most MAX_STRING characters; errors name `name`."""
    tp = str if tp is JobPath else tp
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        raise ConfigError(f"{name} must be one of {_type_name(tp)} (got {_shown(value)})")
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return coerce(name, option, value)
            except ConfigError:
                continue
        raise ConfigError(f"{name} must be {_type_name(tp)} (got {_shown(value)})")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list (got {type(value).__name__} {_shown(value)})")
        if len(value) > MAX_LIST:
            raise ConfigError(f"{name} must have at most {MAX_LIST} items (got {len(value)})")
        item = typing.get_args(tp)[0]
        return tuple(coerce(f"{name}[{i}]", item, v) for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _build_section(name, tp, value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:
                raise ConfigError(f"{name} must be a 64-bit integer (got {_shown(value)})")
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if abs(value) >= 2**63 or not math.isfinite(value):  # 2**63 first: no OverflowError
                raise ConfigError(f"{name} must be a finite number (got {_shown(value)})")
            return float(value)
    elif tp is str and isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ConfigError(f"{name} must be at most {MAX_STRING} characters "
                              f"(got {len(value)})")
        return value
    raise ConfigError(f"{name} must be {_type_name(tp)} "
                      f"(got {type(value).__name__} {_shown(value)})")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # Resolving string annotations is the slow part of parsing a plan, which every agent does
    # on every generation; the sections are a fixed set of classes.
    return typing.get_type_hints(cls)


def _build_section(section: str, cls: type, values: Mapping[str, Any]) -> Any:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{section} must be a table (got {type(values).__name__})")
    hints = _type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown key {section}.{key} (known: {', '.join(sorted(known))})")
    kwargs = {k: coerce(f"{section}.{k}", hints[k], v) for k, v in values.items()}
    return cls(**kwargs)


def _positive(name: str, value: int | float) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1 (got {value})")


def validate(cfg: JobConfig) -> None:
    """Checks that need more than one field. Layout-vs-world checks live in parallel.layout."""
    m, t, p, d, c = cfg.model, cfg.train, cfg.parallel, cfg.data, cfg.checkpoint
    for name, limit in MAX.items():
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key)
        if not isinstance(value, str) and value > limit:
            raise ConfigError(f"{name} must be <= {limit} (got {value})")
    get_spec(m.family).validate(m)
    for key in ("steps", "global_batch", "seq_len"):
        _positive(f"train.{key}", getattr(t, key))
    if t.seq_len > m.max_position_embeddings:
        raise ConfigError(
            f"train.seq_len must be <= model.max_position_embeddings (got {t.seq_len}, {m.max_position_embeddings})"
        )
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(
            f"train.lr must be > 0 and train.min_lr in [0, lr] (got {t.lr}, {t.min_lr})"
        )
    if t.seed < 0:
        raise ConfigError(f"train.seed must be >= 0 (got {t.seed})")
    if t.warmup_steps < 0 or t.weight_decay < 0 or t.grad_clip < 0 or t.eps <= 0:
        raise ConfigError(
            "train.warmup_steps, weight_decay and grad_clip must be >= 0, train.eps > 0"
        )
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be in [0, 1) (got {getattr(t, key)})")
    if p.dp != "auto":
        _positive("parallel.dp", p.dp)
    for key in (*(n for n in mesh_dims.NAMES if n != "dp"), "virtual_stages", "micro_batch"):
        _positive(f"parallel.{key}", getattr(p, key))
    if p.micro_batch > t.global_batch:
        raise ConfigError(
            f"parallel.micro_batch must be <= train.global_batch (got {p.micro_batch}, {t.global_batch})"
        )
    if p.dp != "auto" and not p.pad_uneven and t.global_batch % (p.dp * p.micro_batch):
        raise ConfigError(
            f"train.global_batch must be a multiple of parallel.dp x parallel.micro_batch when "
            f"parallel.pad_uneven is false (got {t.global_batch}, {p.dp} x {p.micro_batch})"
        )
    unknown = [dim for dim in p.replan if dim not in REPLAN_DIMS]
    if unknown or len(set(p.replan)) != len(p.replan):
        raise ConfigError(
            f"parallel.replan must list distinct dimensions of {', '.join(REPLAN_DIMS)} "
            f"(got {list(p.replan)})"
        )
    _validate_data(d)
    if c.every < 0:
        raise ConfigError(f"checkpoint.every must be >= 0 (got {c.every})")
    _positive("checkpoint.keep", c.keep)
    if c.snapshot_every < 0:
        raise ConfigError(f"checkpoint.snapshot_every must be >= 0 (got {c.snapshot_every})")
    if c.storage not in CHECKPOINT_STORAGE:
        raise ConfigError(f"checkpoint.storage must be one of {', '.join(CHECKPOINT_STORAGE)} "
                          f"(got {c.storage!r})")
    if c.every and not c.dir:
        raise ConfigError("checkpoint.dir must be set when checkpoint.every > 0")
    _positive("train.max_skipped_steps", t.max_skipped_steps)
    _validate_metrics(cfg)
    _validate_eval(cfg.eval)
    _validate_fault(cfg.fault)
    _validate_profile(cfg.profile, t.steps)


def _validate_profile(p: ProfileConfig, steps: int) -> None:
    if p.steps and (len(p.steps) != 2 or not 1 <= p.steps[0] < p.steps[1] <= steps):
        raise ConfigError(f"profile.steps must be [first, last] with 1 <= first < last <= "
                          f"train.steps (got {list(p.steps)}, train.steps {steps})")
    if p.ranks != "all" and not all(0 <= r <= MAX_RANK for r in p.ranks):
        raise ConfigError(f"profile.ranks must be global ranks in [0, {MAX_RANK}] or \"all\" "
                          f"(got {list(p.ranks)})")


def _validate_data(d: DataConfig) -> None:
    if sum(map(bool, (d.path, d.source, d.sources))) != 1:
        raise ConfigError(
            "data: set exactly one of data.path (a token file), data.source (a built-in corpus) "
            "or [[data.sources]] (a blend of token files)"
        )
    _validate_sources("data", d.sources)


def _validate_sources(section: str, sources: tuple[DataSource, ...]) -> None:
    for i, s in enumerate(sources):
        if not s.path:
            raise ConfigError(f"{section}.sources[{i}].path must be set")
        if not 0 < s.weight <= MAX_WEIGHT:
            raise ConfigError(f"{section}.sources[{i}].weight must be a finite number in "
                              f"(0, {MAX_WEIGHT:g}] (got {s.weight})")


def _validate_eval(e: EvalConfig) -> None:
    if e.every < 0:
        raise ConfigError(f"eval.every must be >= 0 (got {e.every})")
    if e.samples < 0:
        raise ConfigError(f"eval.samples must be >= 0 (got {e.samples})")
    _validate_sources("eval", e.sources)
    if not e.every:
        return
    if bool(e.path) == bool(e.sources):
        raise ConfigError("eval: set exactly one of eval.path (a token file) or "
                          "[[eval.sources]] (a blend of token files) when eval.every > 0")
    _positive("eval.samples", e.samples)


def _validate_metrics(cfg: JobConfig) -> None:
    if not cfg.metrics.tensorboard:
        return
    if not cfg.job.output_dir:
        raise ConfigError("metrics.tensorboard = true needs job.output_dir (the event files "
                          "go to job.output_dir/tensorboard)")
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("metrics.tensorboard = true needs the tensorboard package, which is "
                          "not installed (pip install 'ultrascale[tensorboard]')")


def _validate_fault(f: FaultConfig) -> None:
    for spec in dataclasses.fields(f):
        value = getattr(f, spec.name)
        if spec.name == "max_failures":
            _positive(f"fault.{spec.name}", value)
        elif not value > 0:
            raise ConfigError(f"fault.{spec.name} must be > 0 (got {value})")
    if f.backoff_max_s < f.backoff_s:
        raise ConfigError(
            f"fault.backoff_max_s must be >= fault.backoff_s (got {f.backoff_max_s}, {f.backoff_s})"
        )


def process_group_timeout(fault: FaultConfig) -> float:
    """Seconds any single collective or rendezvous wait may take before it raises.

    The agent's watchdog is the primary detector: it knows each rank's phase and applies the
    matching deadline, usually far sooner. This bound is the backstop for what the watchdog
    cannot end by itself (a worker whose agent is gone or hung, a peer that never answers),
    replacing torch's 30-minute default. It must not fire before the watchdog on a healthy but
    slow wait: the longest legitimate wait in a collective is another rank still inside a phase
    the watchdog allows (joining, restoring, a first step, an ordinary step), so the bound is the
    largest of those deadlines. A step, or a checkpoint write that ranks wait on together,
    longer than this bound would be cut short by it: such a job must raise first_step_timeout_s.
    """
    return max(
        fault.join_timeout_s,
        fault.restore_timeout_s,
        fault.first_step_timeout_s,
        fault.hang_floor_s,
    )


def from_dict(raw: Mapping[str, Any]) -> JobConfig:
    for section in raw:
        if section not in _SECTIONS:
            raise ConfigError(f"unknown section [{section}] (known: {', '.join(_SECTIONS)})")
    cfg = JobConfig(**{s: _build_section(s, _SECTIONS[s], raw.get(s, {})) for s in _SECTIONS})
    validate(cfg)
    return cfg


def parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value`; the value is read as a TOML value, falling back to a bare string."""
    if "=" not in item:
        raise ConfigError(f"--set expects key.path=value (got {item!r})")
    key, text = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ConfigError(f"--set key must look like section.key (got {key!r})")
    try:
        value = bounded_toml.loads(f"v = {text}", f"--set {key}")["v"]
    except bounded_toml.TooDeep as exc:
        raise ConfigError(str(exc)) from None
    except bounded_toml.TomlError:
        value = text
    return path, value


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    merged: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for item in overrides:
        (section, key), value = parse_override(item)
        if section not in _SECTIONS:
            raise ConfigError(f"unknown key {section}.{key} in --set (no section [{section}])")
        known = {f.name for f in dataclasses.fields(_SECTIONS[section])}
        if key not in known:
            raise ConfigError(
                f"unknown key {section}.{key} in --set (known: {', '.join(sorted(known))})"
            )
        merged.setdefault(section, {})[key] = value
    return merged


def loads(text: str, overrides: Sequence[str] = (), source: str = "<string>") -> JobConfig:
    try:
        raw = bounded_toml.loads(text, source)
    except bounded_toml.TomlError as exc:
        raise ConfigError(str(exc)) from None
    merged = apply_overrides(raw, overrides)
    init = merged.get("init")
    if isinstance(init, Mapping) and init.get("hf"):
        merged = with_pretrained_model(merged)
    return from_dict(merged)


def load(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read job file {path}: {exc.strerror}") from None
    return loads(text, overrides, source=str(path))
