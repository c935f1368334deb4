"""Wire structs exchanged with front-ends (msgspec msgpack, array_like).

Every message on the request socket is ``[type byte frame, payload]`` where the
type byte is an ``EngineCoreRequestType``. Outputs travel as ``EngineCoreOutputs``.
docs/protocol.md is the reference for the bytes.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from enginecore.bounds import Index16, Int64, NonNegInt64, PositiveInt64, finite, name_fields
from enginecore.multimodal.inputs import MultiModalFeatureSpec
from enginecore.sampling_params import SamplingParams


class EngineCoreRequestType(enum.Enum):
    """First frame of every message a front-end sends to the engine."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"


class FinishReason(enum.IntEnum):
    """Why a request finished; encoded as its int value."""

    STOP = 0  # EOS or a stop token
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by a client or by pause(mode="abort")
    ERROR = 3  # rejected or failed; stop_reason says why

    def __str__(self) -> str:
        return self.name.lower()


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):  # type: ignore[call-arg]
    """An adapter a request runs with; ``lora_int_id`` is part of the block hash."""

    lora_name: str
    lora_int_id: PositiveInt64
    lora_path: str = ""


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """Asks for the pooled (embedding) output instead of generated tokens."""

    # None: the model's own setting (its Normalize module).
    normalize: bool | None = None


Timestamp = finite()


class EngineCoreRequest(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False
):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[Int64]
    sampling_params: SamplingParams | None = None
    arrival_time: Timestamp = 0.0
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    data_parallel_rank: Index16 | None = None
    # Index of the front-end that sent it. The engine routes outputs back by the
    # connection the request came in on (and sets this to match).
    client_index: Index16 = 0
    # DP wave the front-end believed current when it sent the request.
    current_wave: NonNegInt64 = 0
    priority: Int64 = 0
    pooling_params: PoolingParams | None = None
    # The request's EOS token (the front-end sets its tokenizer's); None: the model's.
    eos_token_id: NonNegInt64 | None = None
    # Images and other items (vLLM's MultiModalFeatureSpec), ordered by placeholder
    # offset; enginecore.multimodal.inputs.check_mm_features bounds their bytes.
    mm_features: list[MultiModalFeatureSpec] | None = None
    # KV transfer (vLLM's field): what the KV connector needs for this request, e.g.
    # do_remote_decode / do_remote_prefill, remote_engine_id, remote_block_ids,
    # remote_host, remote_port. None also when SamplingParams.extra_args carries it.
    kv_transfer_params: dict[str, Any] | None = None
    # Abort at once after adding, so the connector's request_finished frees what the
    # request reserved before admission (a P/D client that went away).
    abort_immediately: bool = False


class _RequestIdOnly(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """The first field of an ADD (array-like structs ignore trailing items): the id
    of a request that does not decode, so its sender can be answered."""

    request_id: str


_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_request_id_decoder = msgspec.msgpack.Decoder(_RequestIdOnly)


def decode_request(payload: bytes | memoryview) -> EngineCoreRequest:
    """An ADD payload as the engine decodes it; ``ValueError`` naming the bad field
    (types and the numeric bounds of enginecore.bounds included)."""
    try:
        return _request_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed request: {name_fields(e, EngineCoreRequest)}") from None


def encode_request(encoder: msgspec.msgpack.Encoder, request: EngineCoreRequest) -> bytes:
    """The ADD payload of ``request``, checked by decoding it as the engine will:
    whatever the engine would refuse (a float or bool token id, a SamplingParams
    field changed after construction, a schema dict with non-str keys) raises
    ``ValueError`` here, before anything is sent."""
    try:
        payload = encoder.encode(request)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"request {request.request_id!r} cannot be sent: {e}") from None
    decode_request(payload)
    return payload


def readable_request_id(payload: bytes | memoryview) -> str | None:
    """The request id of an ADD payload that does not decode, if it can be read."""
    try:
        return _request_id_decoder.decode(payload).request_id
    except msgspec.DecodeError:
        return None


class Logprobs(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Logprobs of the sampled positions of one request in one step.

    Row i: ``token_ids[i][0]`` is the sampled token, followed by the top-N;
    ``logprobs[i]`` aligns with it; ``ranks[i]`` is the sampled token's rank.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreEventType(enum.IntEnum):
    """Scheduling events of one request (sent only with ``log_stats``)."""

    QUEUED = 1  # the scheduler took it (its waiting queue)
    SCHEDULED = 2  # admitted to run (first time, or again after a preemption)
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    type: EngineCoreEventType
    # time.monotonic() in the engine process (CLOCK_MONOTONIC: comparable with
    # the front-end's on the same machine).
    timestamp: float


class EngineCoreOutput(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False
):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooling_output: list[float] | None = None
    # log_stats: scheduling events since the request's last output (queue-time metrics).
    events: list[EngineCoreEvent] | None = None
    # prompt_logprobs: rows for prompt positions 1..P-1 (row i: prompt token i+1
    # first, then the top-N), sent once, with the request's first token.
    new_prompt_logprobs: Logprobs | None = None
    # KV transfer: what the connector's request_finished returned (with the finish).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityResult(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Return value of a utility call; the client converts it to the method's
    declared return type (``enginecore.core.utility``)."""

    value: Any = None


class UtilityOutput(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False
):  # type: ignore[call-arg]
    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


class PrefixCacheStats(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    reset: bool = False
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


class IterationDetails(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """What one engine step did; attached to stats when enabled."""

    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    elapsed_ms: float = 0.0
    # Multimodal: items encoded this step and their embedding tokens.
    num_encoder_inputs: int = 0
    num_encoder_output_tokens: int = 0


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    num_preempted_total: int = 0
    iteration: IterationDetails | None = None
    # Speculative decoding, cumulative: drafts scheduled and drafts accepted.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_drafts: int = 0
    # accepted drafts by position in the draft (cumulative)
    spec_num_accepted_tokens_per_pos: list[int] = []
    # Multimodal receiver cache lookups since the last stats (queries: items that
    # arrived, hits: items the engine already held; vLLM's mm_cache_stats).
    mm_cache_stats: PrefixCacheStats | None = None
    # KV connector counters since the last stats (vLLM's kv_connector_stats), and
    # tokens loaded through the connector (cumulative); None / 0 without a connector.
    kv_connector_stats: dict[str, Any] | None = None
    num_external_computed_tokens: int = 0
    # Multimodal: the encoder cache's fill (fraction of encoder_cache_size) and
    # its lookups since the last stats (queries: items looked up, hits: found).
    encoder_cache_usage: float = 0.0
    encoder_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)


class EngineCoreOutputs(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False
):  # type: ignore[call-arg]
    engine_index: Index16 = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    # Data parallel waves: set by rank 0 when a wave ends / a request asks for one.
    wave_complete: int | None = None
    start_wave: int | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


# Sent by the engine as the whole payload when it dies, on every output socket.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"



# -- start-up handshake (engine DEALER <-> front-end ROUTER) -----------------------------


class HandshakeHello(msgspec.Struct, tag="HELLO"):
    """Engine -> front-end: the process is up and asks for its addresses."""

    engine_index: int
    pid: int


class HandshakeInit(msgspec.Struct, tag="INIT"):
    """Front-end -> engine: where to connect, and the parallel settings."""

    input_addresses: list[str]
    output_addresses: list[str]
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    # Data parallel: the coordinator's sockets (START_DP_WAVE in, counts and waves out).
    coordinator_input_address: str | None = None
    coordinator_output_address: str | None = None
    # Lockstep: the front-end's TCPStore ("host:port") the DP process group meets at,
    # and the group's generation (a new one per elastic rescale).
    dp_store_address: str | None = None
    dp_group_generation: int = 0


class HandshakeReady(msgspec.Struct, tag="READY"):
    """Engine -> front-end: initialised; the KV cache size it got."""

    engine_index: int
    num_gpu_blocks: int
    max_model_len: int
    stats_address: str | None = None


class HandshakeFailed(msgspec.Struct, tag="FAILED"):
    """Engine -> front-end: start-up failed; ``error`` says why."""

    engine_index: int
    error: str


HandshakeMessage = HandshakeHello | HandshakeInit | HandshakeReady | HandshakeFailed


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Front-end -> engine: call an allow-listed EngineCore method."""

    client_index: Index16
    call_id: Int64
    method: str
    args: list[Any] = []


class StartDPWave(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Coordinator -> engines (payload of START_DP_WAVE): run wave ``wave``; the
    engine ``exclude_engine_index`` asked for it and is running already (-1: none)."""

    wave: int
    exclude_engine_index: int = -1


class WaveStartRequest(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Front-end -> coordinator: a request went to ``engine_index`` while the
    front-end believed the engines idle in wave ``wave``."""

    wave: int
    engine_index: int


class DPStatus(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Coordinator -> front-ends: per-engine ``[waiting, running]`` for load
    balancing, and the wave state."""

    counts: list[list[int]]
    current_wave: int
    engines_running: bool


def engine_identity(engine_index: int) -> bytes:
    """The ZMQ identity of an engine: its index as 2 bytes little endian."""
    return engine_index.to_bytes(2, "little")
