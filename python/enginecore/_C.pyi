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
    """Version of the package the extension was built for."""

# -- block hashing (csrc/block_hash.cpp <-> sched/block_hash.py) ------------------------------

def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None,
                 extra: bytes) -> list[bytes]:
    """Chained sha256 of every full block (twin: ``block_hashes_py``)."""

def sha256(data: bytes) -> bytes:
    """One-shot SHA-256 (for tests of the compression function)."""

def sha256_impl() -> str:
    """Which compression runs: 'sha-ni' or 'portable'."""

def sha256_force_portable(force: bool) -> None:
    """Use the portable compression even where SHA-NI exists (tests)."""

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
    msgspec's encoding of the equivalent EngineCoreOutputs)."""

def libzmq_path() -> str | None:
    """Path of the libzmq pyzmq loaded (the one send_columnar uses), or None."""

def send_columnar(socket: int, engine_index: int, request_ids: list[str | None],
                  new_token_ids: list[Any], specials: list[Any], stats_raw: bytes | None,
                  timestamp: float, max_size: int = -1) -> bool:
    """Encode one client's step outputs and send them on the zmq socket whose handle is
    ``socket`` (pyzmq's ``Socket.underlying``) without the GIL; False (nothing sent) when
    the message would pass ``max_size`` bytes."""

# -- scheduler loops (csrc/scheduler_update.cpp <-> sched/scheduler*.py) ----------------------

def finish_running(scheduled_running: list[Any],
                   num_scheduled_tokens: dict[str, int]) -> tuple[list[str], list[int], bool]:
    """The running requests' ids, computed counts and grammar flag; counts advanced
    (twin: ``finish_running_py``)."""

def update_decodes(requests: dict[str, Any], scheduled: dict[str, int], sampled: list[list[int]],
                   req_ids: list[str], index_of: dict[str, int], in_flight: set[str] | None,
                   max_model_len: int, statuses: tuple[Any, Any, Any], cols: dict[int, Any],
                   stopped_list: list[Any], columnar_type: type, emit_finished: Any,
                   update_request: Any, failed: list[tuple[str, str]]) -> None:
    """The plain-decode loop of ``Scheduler.update_from_output``: each plain decode two
    appends to its client's ColumnarOutputs (``columnar_type``) in ``cols``."""

def schedule_running(running: list[Any], in_flight: Any, token_budget: int, threshold: int,
                     max_len_1: int, kv: Any, req_to_blocks: dict[str, list[Any]],
                     num_cached_blocks: dict[str, int], block_size: int, enable_caching: bool,
                     block_pool: Any, scheduled_running: list[Any],
                     running_new_blocks: list[Any],
                     num_scheduled_tokens: dict[str, int]) -> tuple[int, int]:
    """The common-case prefix of ``Scheduler.schedule()``'s running loop: (index of the
    first running request left to Python, token budget left)."""

# -- the synthetic executor (csrc/synthetic_sampler.cpp <-> executor/synthetic.py) ------------

def synthetic_sample(scheduled: dict[str, int], spec: dict[str, list[int]],
                     state: dict[str, list[int]], cached_ids: list[str],
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
    sequence's query tokens over its context (twin: ``attention.paged_attention_torch``)."""

def rms_norm(x: int, x_stride: int, delta: int, delta_stride: int, weight: int, out: int,
             out_stride: int, rows: int, hidden: int, eps: float, dtype: int,
             num_threads: int) -> None:
    """out = weight * rmsnorm(x) per row; with delta != 0, x += delta first (in place)."""

def rope(x: int, x_st: int, x_sh: int, positions: int, cos: int, sin: int, table_stride: int,
         tokens: int, num_heads: int, rotary_dim: int, dtype: int, num_threads: int) -> None:
    """Rotate-half RoPE in place on [tokens, heads, head_dim] at int64 positions."""

def silu_and_mul(x: int, x_stride: int, out: int, out_stride: int, rows: int, width: int,
                 dtype: int, num_threads: int) -> None:
    """out = silu(gate) * up for rows of [gate | up]."""

def cpu_kernels_info() -> dict[str, str]:
    """The instruction set the CPU model kernels run with and the OpenMP runtime (torch's)
    they split work on ('' = serial)."""
