"""Type stub of ``enginecore._C``, the C++ extension (csrc/, bound in csrc/bindings.cpp).

Every hot path here has a pure-Python twin named after it (``_C.name`` <->
``name_py``, ``_C.Name`` <-> ``PyName``; docs/architecture.md, "Native pieces");
``enginecore._native`` picks one. Pointer arguments are tensors' ``data_ptr()``s
and strides are in elements; ``dtype`` is 0 (float32) or 1 (bfloat16).
tests/test_native.py checks that the names here are exactly the module's.
"""

from collections.abc import Sequence
from typing import Any

def version() -> str:
    """Version of the package the extension was built for (twin: ``_native.version_py``)."""

# -- block hashing (csrc/block_hash.cpp <-> sched/block_hash.py) ------------------------------

def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None,
                 extra: bytes) -> list[bytes]:
    """Chained sha256 of every full block (twin: ``block_hashes_py``)."""

def sha256(data: bytes) -> bytes:
    """One-shot SHA-256 (for tests of the compression function; twin: ``sha256_py``)."""

def sha256_impl() -> str:
    """Which compression runs: 'sha-ni' or 'portable' (twin: ``sha256_impl_py``)."""

def sha256_force_portable(force: bool) -> None:
    """Use the portable compression even where SHA-NI exists (tests; twin:
    ``sha256_force_portable_py``)."""

# -- queues (csrc/blocking_queue.cpp <-> blocking_queue.py) -----------------------------------

class BlockingQueue:
    """GIL-free blocking FIFO (twin: ``PyBlockingQueue``); raises ``queue.Empty`` /
    ``queue.Full`` as ``queue.Queue`` does."""

    def __init__(self, maxsize: int = 0) -> None: ...
    def put(self, item: Any) -> None: ...
    def put_nowait(self, item: Any) -> None: ...
    def get(self, timeout: float | None = None) -> Any: ...
    def get_nowait(self) -> Any: ...
    def peek(self) -> Any: ...
    def qsize(self) -> int: ...
    def empty(self) -> bool: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    @property
    def maxsize(self) -> int: ...

# -- step outputs (csrc/output_encoder.cpp, csrc/zmq_send.cpp <-> sched/columnar_outputs.py) --

def encode_columnar(engine_index: int, request_ids: list[str | None], new_token_ids: list[Any],
                    specials: list[Any], stats_raw: bytes | None, timestamp: float,
                    buf: bytearray) -> None:
    """msgpack of one client's step outputs from columns into ``buf`` (bytes equal
    msgspec's encoding of the equivalent EngineCoreOutputs; twin: ``serial.encode_columnar_py``)."""

def libzmq_path() -> str | None:
    """Path of the libzmq pyzmq loaded (the one send_columnar uses), or None (twin:
    ``serial.libzmq_path_py``)."""

def send_columnar(socket: int, engine_index: int, request_ids: list[str | None],
                  new_token_ids: list[Any], specials: list[Any], stats_raw: bytes | None,
                  timestamp: float, max_size: int = -1) -> bool:
    """Encode one client's step outputs and send them on the zmq socket whose handle is
    ``socket`` (pyzmq's ``Socket.underlying``) without the GIL; False (nothing sent) when
    the message would pass ``max_size`` bytes (twin: ``serial.send_columnar_py``)."""

# -- the scheduler's structures (csrc/block_pool.cpp, csrc/request_table.cpp
#    <-> sched/block_pool.py, sched/request_table.py) ----------------------------------------

class BlockPool:
    """KV blocks by id: ref counts, LRU free queue, hash -> block (twin: ``PyBlockPool``)."""
    def __init__(self, num_blocks: int, enable_caching: bool) -> None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def enable_caching(self) -> bool: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_evictions(self) -> int: ...
    def get_num_free_blocks(self) -> int: ...
    def get_usage(self) -> float: ...
    def get_cached_block(self, block_hash: bytes) -> int | None: ...
    def ref_cnt(self, block_id: int) -> int: ...
    def block_hash(self, block_id: int) -> bytes | None: ...
    def num_cached_blocks(self) -> int: ...
    def free_block_ids(self) -> list[int]: ...
    def get_new_blocks(self, num_blocks: int) -> list[int]: ...
    def touch(self, block_ids: Sequence[int]) -> None: ...
    def free_blocks(self, ordered_block_ids: Sequence[int]) -> None: ...
    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[bytes],
                          start: int, end: int) -> None: ...
    def uncache(self, block_ids: Sequence[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...

class RequestTable:
    """Per-request hot state by slot: tokens, counts, stop parameters, block table,
    block hashes (twin: ``PyRequestTable``; ``Request`` is a view of one row)."""
    def __init__(self, block_pool: BlockPool | None, block_size: int) -> None: ...
    @property
    def block_pool(self) -> BlockPool | None: ...
    @property
    def block_size(self) -> int: ...
    def add(self, request_id: str, prompt_token_ids: Sequence[int], client_index: int,
            max_tokens: int, min_tokens: int, eos_token_id: int, ignore_eos: bool,
            stop_token_ids: Sequence[int], priority: int, arrival_time: float,
            extra_keys: bytes, hash_blocks: bool,
            block_extra_keys: Sequence[bytes] = ()) -> int: ...
    def export_row(self, slot: int) -> tuple[Any, ...]: ...
    def import_row(self, state: tuple[Any, ...]) -> int: ...
    def release(self, slot: int) -> None: ...
    def __len__(self) -> int: ...
    def block_tables(self) -> dict[str, list[int]]: ...
    def get_request_id(self, slot: int) -> str: ...
    def get_status(self, slot: int) -> int: ...
    def set_status(self, slot: int, status: int) -> None: ...
    def get_num_computed_tokens(self, slot: int) -> int: ...
    def set_num_computed_tokens(self, slot: int, n: int) -> None: ...
    def get_num_tokens(self, slot: int) -> int: ...
    def get_num_prompt_tokens(self, slot: int) -> int: ...
    def get_token_ids(self, slot: int) -> list[int]: ...
    def get_output_token_ids(self, slot: int) -> list[int]: ...
    def get_client_index(self, slot: int) -> int: ...
    def get_spec_token_ids(self, slot: int) -> list[int]: ...
    def set_spec_token_ids(self, slot: int, token_ids: Sequence[int]) -> None: ...
    def set_has_grammar(self, slot: int, has_grammar: bool) -> None: ...
    def get_block_hashes(self, slot: int) -> list[bytes]: ...
    def get_num_block_hashes(self, slot: int) -> int: ...
    def get_block_ids(self, slot: int) -> list[int]: ...
    def get_num_cached_blocks(self, slot: int) -> int: ...
    def append_token_ids(self, slot: int, token_ids: Sequence[int]) -> None: ...
    def check_stop(self, slot: int, max_model_len: int) -> int: ...
    def get_computed_blocks(self, slot: int, max_hit_blocks: int) -> list[int]: ...
    def allocate_slots(self, slot: int, num_new_tokens: int, num_new_computed_tokens: int,
                       new_computed_blocks: Sequence[int], num_lookahead_tokens: int,
                       max_model_len: int) -> list[int] | None: ...
    def free_blocks(self, slot: int) -> None: ...
    def uncache_from(self, slot: int, num_tokens: int) -> None: ...

# -- scheduler loops (csrc/scheduler_loops.cpp <-> sched/scheduler_loops.py) -----------------

def schedule_running(table: RequestTable, running: list[Any], skip: Any, in_flight: Any,
                     token_budget: int, threshold: int, max_len_1: int, max_model_len: int,
                     priority: bool) -> tuple[Any, ...]:
    """``Scheduler.schedule()``'s running loop, preemption included: a
    ``RunningSchedule``'s fields as a tuple (twin: ``schedule_running_py``)."""

def update_decodes(table: RequestTable, slot_of: dict[str, int], scheduled: dict[str, int],
                   sampled: list[list[int]], req_ids: list[str], index_of: dict[str, int],
                   in_flight: set[str] | None, max_model_len: int) -> tuple[Any, ...]:
    """The plain-decode loop of ``Scheduler.update_from_output``: a ``DecodeUpdate``'s
    fields as a tuple (twin: ``update_decodes_py``)."""

# -- the synthetic executor (csrc/synthetic_sampler.cpp <-> executor/synthetic.py) ------------

def synthetic_sample(scheduled: dict[str, int], spec: dict[str, list[int]],
                     state: dict[str, bytearray], cached_ids: list[str],
                     cached_computed: list[int], new_computed: dict[str, int],
                     vocab_size: int) -> tuple[list[str], dict[str, int], list[list[int]]]:
    """The synthetic executor's per-request loop (twin: ``synthetic_sample_py``)."""

# -- model kernels (csrc/paged_attention.cpp, csrc/fused_ops.cpp <-> model/) ------------------

def paged_attention(out: int, out_st: int, out_sh: int, q: int, q_st: int, q_sh: int,
                    k_new: int, k_st: int, k_sh: int, v_new: int, v_st: int, v_sh: int,
                    slot_mapping: int, num_tokens: int, k_cache: int, v_cache: int, c_ss: int,
                    c_sh: int, block_table: int, bt_stride: int, query_start: int,
                    seq_lens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, dtype: int, scale: float, soft_cap: float,
                    sliding_window: int, num_threads: int) -> None:
    """Write the step's K/V into the paged cache (``k_new=0``: skip) and attend every
    sequence's query tokens over its context (twin: ``model.kernel_twins.paged_attention_py``)."""

def rms_norm(x: int, x_stride: int, delta: int, delta_stride: int, weight: int, out: int,
             out_stride: int, rows: int, hidden: int, eps: float, dtype: int,
             num_threads: int) -> None:
    """out = weight * rmsnorm(x) per row; with delta != 0, x += delta first (in place)
    (twin: ``model.kernel_twins.rms_norm_py``)."""

def rope(x: int, x_st: int, x_sh: int, positions: int, cos: int, sin: int, table_stride: int,
         tokens: int, num_heads: int, rotary_dim: int, dtype: int, num_threads: int) -> None:
    """Rotate-half RoPE in place on [tokens, heads, head_dim] at int64 positions (twin:
    ``model.kernel_twins.rope_py``)."""

def silu_and_mul(x: int, x_stride: int, out: int, out_stride: int, rows: int, width: int,
                 dtype: int, num_threads: int) -> None:
    """out = silu(gate) * up for rows of [gate | up] (twin:
    ``model.kernel_twins.silu_and_mul_py``)."""

def bf16_linear(x: int, x_stride: int, rows: int, panels: int, bias: int, out: int,
                out_stride: int, in_features: int, out_features: int, num_threads: int) -> None:
    """out[rows, out_features] = x W^T (+ bias) in bfloat16, float32 FMA inside, W in
    16-feature panels [ceil(N/16)][K][16] (``model.linear.pack_panels``); bias 0: none;
    ``out`` must not overlap ``x`` (twin: ``model.kernel_twins.bf16_linear_py``)."""

def cpu_kernels_info() -> dict[str, str | bool | int]:
    """The instruction set the CPU model kernels run with (``isa``: avx512 / avx2 /
    baseline), the OpenMP runtime (torch's) they split work on (``openmp``, '' = serial),
    the CPU's ``avx2`` / ``avx512f`` / ``avx512_bf16`` / ``amx`` (CPUID and the OS's
    XSAVE state), ``amx_permission`` (Linux's arch_prctl: granted / not requested) and
    ``amx_kernels`` (none ship), ``bf16_linear`` (the ISA of bf16_linear's tiles: avx2 /
    portable), ``attention_decode`` (the decode attention's path: "avx512 registers" or
    generic), ``bf16_gemv`` (avx512_bf16 / none), ``starved_team_spells`` (times the
    team was found starved by another process on its cores and the next calls ran on
    one thread). Twin:
    ``model.kernel_twins.cpu_kernels_info_py``."""

def bind_openmp_threads(cpus: list[int]) -> list[int]:
    """Bind thread i of torch's OpenMP team of len(cpus) threads to cpus[i]; returns each
    thread's tid (-1: not bound). Twin: ``executor.cpu_threads.bind_openmp_threads_py``."""

def greedy_argmax(logits: int, row_stride: int, rows: int, cols: int, out: int, dtype: int,
                  num_threads: int) -> None:
    """out[r] (int64) = the first index of the maximum of logits row r, a NaN counting as
    the maximum (twin: ``model.kernel_twins.greedy_argmax_py``, torch.argmax)."""

def sample_rows(logits: int, row_stride: int, rows: int, cols: int, dtype: int,
                temperature: int, keys: int, out: int, num_threads: int) -> None:
    """out[r] (int64) = a draw from softmax(x_r; -inf never drawn), x_r = logits row r
    (float32, or bf16 for dtype 1) in float32 divided by float32 temperature[r] (address
    0: none; each > 0 and finite): the exponential race argmax_j exp(x_j - max) / E_j
    with E_j = -log(u_j), u_j hashed from (keys[r], j) (``sampler.race_uniforms``); a row
    whose max is NaN or infinite gives its argmax (twin:
    ``model.kernel_twins.sample_rows_py``, ``sampler.sample_rows_torch``)."""

def logprob_rows(logits: int, row_stride: int, rows: int, cols: int, dtype: int, tokens: int,
                 n: int, token_lp: int, rank: int, top_ids: int, top_lp: int,
                 num_threads: int) -> None:
    """Per row r of logits (float32, or bf16 for dtype 1), lp_j = (x_j - max) -
    log(sum exp(x - max)) in float64 rounded to float32 (NaN where the max is not
    finite): token_lp[r] = lp of tokens[r] (int64, in [0, cols)), rank[r] = 1 + the
    count of x_j > x_tokens[r], top_ids[r, :n] / top_lp[r, :n] the n first in (x desc,
    index asc) order, NaN above +inf, -0 below +0 (twin:
    ``model.kernel_twins.logprob_rows_py``, ``sampler.logprob_rows_torch``)."""

def top_p_rows(logits: int, row_stride: int, rows: int, cols: int, top_p: int,
               num_threads: int) -> None:
    """In place on float32 logits: rank row r by (logit desc, index asc) and set to -inf
    every token whose more likely tokens already weigh >= top_p[r] (float64 in (0, 1])
    of the row (weights exp(logit - max) in float64); a row whose max is NaN or infinite,
    or whose top_p is 1, is left alone (twin: ``model.kernel_twins.top_p_rows_py``,
    ``sampler.top_p_rows_torch``)."""

def team_thread_ids(num_threads: int) -> list[int]:
    """The Linux thread id of each member of torch's OpenMP team of num_threads threads
    (member 0 is the calling thread); -1 where unknown. No twin: the Python path's
    ``StarvationGovernor`` reads every thread of the process."""

def bf16_gemv(x: int, x_stride: int, rows: int, weight: int, bias: int, out: int,
              out_stride: int, in_features: int, out_features: int, num_threads: int) -> None:
    """out[rows, out_features] = x W^T (+ bias) for 1-4 rows, bfloat16 in and out, the
    plain [out_features, in_features] weight read once, exact products in a fixed float32
    order (bias 0: none; raises RuntimeError without AVX512_BF16). Twin:
    ``model.kernel_twins.bf16_gemv_py``, the same bits."""

def bf16_gemv_available() -> bool:
    """Whether this CPU runs ``bf16_gemv`` (AVX512_BF16). Twin: the same, by CPU flags."""
