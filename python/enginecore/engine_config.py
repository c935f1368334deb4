"""The typed engine configuration: what ``EngineArgs.create_engine_config`` builds and
every room reads (``EngineConfig`` and its sections), apart from the flat CLI-facing
``EngineArgs`` in config.py (which re-exports these names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from enginecore.kv_transfer.kv_transfer_config import KVTransferConfig
from enginecore.model_config import ModelConfig
from enginecore.sched.request_queue import SchedulingPolicy

ExecutorBackend = Literal["uniproc", "synthetic"]


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks_override: int | None = None
    # CPU: bytes of KV cache; None = a fraction of free RAM, capped (see executor).
    kv_cache_memory_bytes: int | None = None
    # CUDA: fraction of device memory the engine may use in all.
    gpu_memory_utilization: float = 0.9
    # Set once the KV cache is sized.
    num_gpu_blocks: int | None = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # A prefill chunk of a request is capped at this many tokens (0 = no cap).
    long_prefill_token_threshold: int = 0
    # Lockstep data parallel: new prefills are admitted only on steps that are a
    # multiple of this (1 = every step), so ranks prefill together.
    prefill_schedule_interval: int = 1
    # Multimodal (vLLM's names): encoder tokens (placeholder tokens of the items
    # encoded) one step may compute, and the encoder cache's size in such tokens;
    # None: max_num_batched_tokens. Raised to the largest item a request brings.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    # A prefill chunk never ends inside a placeholder range it starts before.
    disable_chunked_mm_input: bool = False


@dataclass
class ParallelConfig:
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_size_local: int = 1
    # First rank this node runs (a headless node runs ranks start..start+local-1).
    data_parallel_start_rank: int = 0
    # Where the front-end's handshake socket listens when ranks run elsewhere.
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 0
    # External load balancing: this front-end talks only to its own rank.
    data_parallel_external_lb: bool = False
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    # Ranks step in lockstep waves with a collective every 32 steps (MoE models);
    # off: independent engines behind the same coordinator (dense models).
    data_parallel_lockstep: bool = False

    @property
    def data_parallel_rank_local(self) -> int:
        return self.data_parallel_rank - self.data_parallel_start_rank


@dataclass
class ExecutorConfig:
    backend: ExecutorBackend = "uniproc"
    max_concurrent_batches: int = 1
    # SyntheticExecutor only: seconds each step takes.
    synthetic_step_latency_s: float = 0.0
    # start_profile / stop_profile write torch profiler traces here (None: off).
    profiler_dir: str | None = None
    # CPU compute threads (None: one per core) and their binding (None: the
    # environment's VLLM_CPU_OMP_THREADS_BIND, else auto); executor/cpu_threads.py.
    cpu_threads: int | None = None
    cpu_threads_bind: str | None = None


@dataclass
class SpeculativeConfig:
    """N-gram (prompt lookup) speculative decoding; off when num_speculative_tokens is 0."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


@dataclass
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16


@dataclass
class TransportConfig:
    """The links between front-ends and engines (docs/protocol.md)."""

    # ZMTP heartbeats, on TCP links only: a local (IPC) peer that dies closes its
    # connection at once, and a stalled one (SIGSTOP, swap, a long GC) must not
    # count as dead. Remote: a peer silent for heartbeat_timeout_s is gone.
    heartbeat_interval_s: float = 5.0
    heartbeat_timeout_s: float = 60.0
    # ZMQ_MAXMSGSIZE on every socket; the client refuses a larger request itself.
    max_message_bytes: int = 64 << 20
    # CurveZMQ on TCP links (None: on when libzmq has CURVE, else an error).
    curve: bool | None = None
    # Headless ranks: where the front-end writes the ranks' keys (0600) and the
    # ranks read them (default: under the cache dir, named by the RPC port).
    curve_key_file: str | None = None
    # The keys of this launch (transport.CurveKeys), handed to the engines the
    # front-end starts inside their config: out of band, never over a socket.
    curve_keys: Any = None


@dataclass
class StructuredOutputsConfig:
    # CPU time one request's token mask may take in a step (and its first mask, at
    # compile time, off the busy loop); a constraint that needs more is that
    # request's ERROR, so one pathological regex cannot slow every request.
    mask_budget_ms: float = 10.0


@dataclass
class MultiModalConfig:
    """Front-end limits on images (vLLM's names; multimodal/ reads them)."""

    # Items per prompt by modality; a modality not named: MM_DEFAULT_LIMIT_PER_PROMPT.
    limit_mm_per_prompt: dict[str, int] = dataclasses.field(default_factory=dict)
    # Hosts whose http(s) image URLs the server fetches; empty: data: URLs only.
    allowed_media_domains: list[str] = dataclasses.field(default_factory=list)
    media_fetch_timeout_s: float = 5.0
    media_max_bytes: int = 20 << 20
    # Decoded pixels (width x height) one image may have: decompression bombs stop here.
    max_image_pixels: int = 64 << 20
    # The sender cache (front-end) and receiver cache (engine): processed items
    # kept by identifier, so an item is sent once; 0: off.
    mm_processor_cache_gb: float = 4.0




@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    executor_config: ExecutorConfig
    # None: the environment decides (ENGINECORE_NATIVE); True/False forces a path.
    use_native: bool | None = None
    # Stats every step (to front-ends) and a log line every log_stats_interval_s.
    log_stats: bool = False
    log_stats_interval_s: float = 10.0
    log_iteration_details: bool = False
    speculative_config: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    lora_config: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    transport_config: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    structured_outputs_config: StructuredOutputsConfig = dataclasses.field(
        default_factory=StructuredOutputsConfig)
    multimodal_config: MultiModalConfig = dataclasses.field(default_factory=MultiModalConfig)
    # KV transfer (vLLM's kv_transfer_config): None, no KV connector.
    kv_transfer_config: KVTransferConfig | None = None
