# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Layout(_message.Message):
    __slots__ = ("dp", "tp", "pp", "cp", "ep")
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    def __init__(self, dp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., cp: _Optional[int] = ..., ep: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("job", "node", "state", "generation", "step", "world_size", "layout", "leader", "consumed_samples", "loss", "finished", "nodes", "reason", "agent_state", "total_steps")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AGENT_STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    job: str
    node: str
    state: str
    generation: int
    step: int
    world_size: int
    layout: Layout
    leader: str
    consumed_samples: int
    loss: float
    finished: bool
    nodes: int
    reason: str
    agent_state: str
    total_steps: int
    def __init__(self, job: _Optional[str] = ..., node: _Optional[str] = ..., state: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., leader: _Optional[str] = ..., consumed_samples: _Optional[int] = ..., loss: _Optional[float] = ..., finished: _Optional[bool] = ..., nodes: _Optional[int] = ..., reason: _Optional[str] = ..., agent_state: _Optional[str] = ..., total_steps: _Optional[int] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Node(_message.Message):
    __slots__ = ("node", "address", "metrics_url", "devices", "state", "pid", "leader", "version")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    metrics_url: str
    devices: int
    state: str
    pid: int
    leader: bool
    version: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., metrics_url: _Optional[str] = ..., devices: _Optional[int] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., leader: _Optional[bool] = ..., version: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Plan(_message.Message):
    __slots__ = ("generation", "plan_json", "state", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    plan_json: str
    state: str
    reason: str
    def __init__(self, generation: _Optional[int] = ..., plan_json: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec_toml", "overrides", "replace")
    SPEC_TOML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    spec_toml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    replace: bool
    def __init__(self, spec_toml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ..., replace: _Optional[bool] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job", "revision")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    job: str
    revision: int
    def __init__(self, job: _Optional[str] = ..., revision: _Optional[int] = ...) -> None: ...

class NodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class NodeResponse(_message.Message):
    __slots__ = ("node", "state", "request_id")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    node: str
    state: str
    request_id: str
    def __init__(self, node: _Optional[str] = ..., state: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job", "revision", "request_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    revision: int
    request_id: str
    def __init__(self, job: _Optional[str] = ..., revision: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("job", "revision", "spec_toml", "overrides", "config_json", "submitted_at", "state")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job: str
    revision: int
    spec_toml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    config_json: str
    submitted_at: float
    state: str
    def __init__(self, job: _Optional[str] = ..., revision: _Optional[int] = ..., spec_toml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ..., config_json: _Optional[str] = ..., submitted_at: _Optional[float] = ..., state: _Optional[str] = ...) -> None: ...

class WorkerLogRequest(_message.Message):
    __slots__ = ("node", "local_rank", "tail_lines", "follow")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    TAIL_LINES_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    node: str
    local_rank: int
    tail_lines: int
    follow: bool
    def __init__(self, node: _Optional[str] = ..., local_rank: _Optional[int] = ..., tail_lines: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class WorkerLogChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("follow",)
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    follow: bool
    def __init__(self, follow: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("revision", "kind", "node", "generation", "message")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    revision: int
    kind: str
    node: str
    generation: int
    message: str
    def __init__(self, revision: _Optional[int] = ..., kind: _Optional[str] = ..., node: _Optional[str] = ..., generation: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GenerationRequest(_message.Message):
    __slots__ = ("after_generation", "local_rank", "global_rank", "wait_seconds")
    AFTER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    after_generation: int
    local_rank: int
    global_rank: int
    wait_seconds: float
    def __init__(self, after_generation: _Optional[int] = ..., local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class GenerationPlan(_message.Message):
    __slots__ = ("generation", "plan_json", "changed", "global_rank", "local_rank", "world_size", "store_host", "store_port", "exit", "store_prefix")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    STORE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    generation: int
    plan_json: str
    changed: bool
    global_rank: int
    local_rank: int
    world_size: int
    store_host: str
    store_port: int
    exit: bool
    store_prefix: str
    def __init__(self, generation: _Optional[int] = ..., plan_json: _Optional[str] = ..., changed: _Optional[bool] = ..., global_rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., exit: _Optional[bool] = ..., store_prefix: _Optional[str] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("generation", "global_rank", "step", "loss", "tokens", "consumed_samples", "step_seconds", "world_size", "dp", "memory_params_bytes", "memory_grads_bytes", "memory_optimizer_bytes", "memory_activations_bytes", "memory_peak_bytes", "bubble_ratio", "recompute_seconds", "recompute_ratio", "local_rank", "snapshot_blocking_seconds", "checkpoint_blocking_seconds", "learning_rate", "grad_norm", "mfu", "skipped", "eval_loss", "aux_loss", "expert_load", "dropped_tokens")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PARAMS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GRADS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_OPTIMIZER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ACTIVATIONS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_RATIO_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BLOCKING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BLOCKING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    global_rank: int
    step: int
    loss: float
    tokens: int
    consumed_samples: int
    step_seconds: float
    world_size: int
    dp: int
    memory_params_bytes: float
    memory_grads_bytes: float
    memory_optimizer_bytes: float
    memory_activations_bytes: float
    memory_peak_bytes: float
    bubble_ratio: float
    recompute_seconds: float
    recompute_ratio: float
    local_rank: int
    snapshot_blocking_seconds: float
    checkpoint_blocking_seconds: float
    learning_rate: float
    grad_norm: float
    mfu: float
    skipped: str
    eval_loss: float
    aux_loss: float
    expert_load: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    dropped_tokens: int
    def __init__(self, generation: _Optional[int] = ..., global_rank: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., consumed_samples: _Optional[int] = ..., step_seconds: _Optional[float] = ..., world_size: _Optional[int] = ..., dp: _Optional[int] = ..., memory_params_bytes: _Optional[float] = ..., memory_grads_bytes: _Optional[float] = ..., memory_optimizer_bytes: _Optional[float] = ..., memory_activations_bytes: _Optional[float] = ..., memory_peak_bytes: _Optional[float] = ..., bubble_ratio: _Optional[float] = ..., recompute_seconds: _Optional[float] = ..., recompute_ratio: _Optional[float] = ..., local_rank: _Optional[int] = ..., snapshot_blocking_seconds: _Optional[float] = ..., checkpoint_blocking_seconds: _Optional[float] = ..., learning_rate: _Optional[float] = ..., grad_norm: _Optional[float] = ..., mfu: _Optional[float] = ..., skipped: _Optional[str] = ..., eval_loss: _Optional[float] = ..., aux_loss: _Optional[float] = ..., expert_load: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., dropped_tokens: _Optional[int] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("stop_now", "stop", "checkpoint_seq")
    STOP_NOW_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SEQ_FIELD_NUMBER: _ClassVar[int]
    stop_now: bool
    stop: bool
    checkpoint_seq: int
    def __init__(self, stop_now: _Optional[bool] = ..., stop: _Optional[bool] = ..., checkpoint_seq: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("local_rank", "generation", "phase", "step")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    generation: int
    phase: str
    step: int
    def __init__(self, local_rank: _Optional[int] = ..., generation: _Optional[int] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("generation", "global_rank", "message", "local_rank", "kind", "step", "failed_at")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FAILED_AT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    global_rank: int
    message: str
    local_rank: int
    kind: str
    step: int
    failed_at: float
    def __init__(self, generation: _Optional[int] = ..., global_rank: _Optional[int] = ..., message: _Optional[str] = ..., local_rank: _Optional[int] = ..., kind: _Optional[str] = ..., step: _Optional[int] = ..., failed_at: _Optional[float] = ...) -> None: ...

class FailureReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DoneReport(_message.Message):
    __slots__ = ("generation", "global_rank", "step", "local_rank", "stopped", "consumed_samples")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    global_rank: int
    step: int
    local_rank: int
    stopped: bool
    consumed_samples: int
    def __init__(self, generation: _Optional[int] = ..., global_rank: _Optional[int] = ..., step: _Optional[int] = ..., local_rank: _Optional[int] = ..., stopped: _Optional[bool] = ..., consumed_samples: _Optional[int] = ...) -> None: ...

class DoneReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointReport(_message.Message):
    __slots__ = ("generation", "global_rank", "step", "path", "local_rank", "seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    global_rank: int
    step: int
    path: str
    local_rank: int
    seconds: float
    def __init__(self, generation: _Optional[int] = ..., global_rank: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., local_rank: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CheckpointReportReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotRanges(_message.Message):
    __slots__ = ("step", "ranges")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    step: int
    ranges: _containers.RepeatedCompositeFieldContainer[FileRange]
    def __init__(self, step: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[FileRange, _Mapping]]] = ...) -> None: ...

class FileRange(_message.Message):
    __slots__ = ("file", "offset", "length")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    length: int
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class SnapshotPiece(_message.Message):
    __slots__ = ("range", "data")
    RANGE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    range: int
    data: bytes
    def __init__(self, range: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RestoreReport(_message.Message):
    __slots__ = ("generation", "global_rank", "local_rank", "source", "step", "skipped", "seconds", "snapshot_bytes")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    global_rank: int
    local_rank: int
    source: str
    step: int
    skipped: str
    seconds: float
    snapshot_bytes: int
    def __init__(self, generation: _Optional[int] = ..., global_rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., source: _Optional[str] = ..., step: _Optional[int] = ..., skipped: _Optional[str] = ..., seconds: _Optional[float] = ..., snapshot_bytes: _Optional[int] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldingsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldingsReply(_message.Message):
    __slots__ = ("holdings_json",)
    HOLDINGS_JSON_FIELD_NUMBER: _ClassVar[int]
    holdings_json: str
    def __init__(self, holdings_json: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("step", "file", "size", "chunks", "chunk_bytes", "rank", "data", "sender", "spec_revision", "generation", "mac")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SPEC_REVISION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    step: int
    file: str
    size: int
    chunks: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    rank: int
    data: bytes
    sender: str
    spec_revision: int
    generation: int
    mac: bytes
    def __init__(self, step: _Optional[int] = ..., file: _Optional[str] = ..., size: _Optional[int] = ..., chunks: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ..., rank: _Optional[int] = ..., data: _Optional[bytes] = ..., sender: _Optional[str] = ..., spec_revision: _Optional[int] = ..., generation: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class FileAck(_message.Message):
    __slots__ = ("step", "file", "error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step: int
    file: str
    error: str
    def __init__(self, step: _Optional[int] = ..., file: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
