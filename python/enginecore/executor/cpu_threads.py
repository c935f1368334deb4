"""How many compute threads an engine on the CPU runs, and on which cores.

vLLM's knobs, same spellings and meaning:

* ``VLLM_CPU_OMP_THREADS_BIND`` (or ``EngineArgs.cpu_threads_bind``): ``auto``
  (default), ``nobind`` / ``all`` (no binding), or a CPU list such as ``0-3,8``;
  ``|`` separates the lists of the data-parallel ranks on this node
  (``0-3|4-7``: local rank 0 on CPUs 0-3, rank 1 on 4-7). One thread per listed CPU.
* ``VLLM_CPU_NUM_OF_RESERVED_CPU``: with ``auto``, CPUs left to the front-end
  (API server, tokenizer, output processing); default 1.
* ``EngineArgs.cpu_threads`` (``--cpu-threads``): at most this many threads.

``auto``: one CPU per physical core (SMT siblings are left out: two threads on
one core contend for the same FMA units), the reserved CPUs taken off the end,
the rest split among the node's local ranks; threads are bound one per CPU.
On a machine of two cores or fewer nothing is reserved and nothing is bound: the
engine needs both cores, and the kernel must stay free to move a thread off a core
that another process holds (binding there halves throughput under contention,
docs/benchmarks.md). The wait policy (spin, then sleep) is set earlier, before
torch loads OpenMP (omp_env.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from enginecore import _native, omp_env

logger = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# "0" / "off": torch keeps its whole team even while another process starves it.
GOVERNOR_ENV = "ENGINECORE_CPU_GOVERNOR"
# Up to this many usable cores, auto reserves and binds nothing.
SMALL_MACHINE_CORES = 2

_applied: dict[str, object] = {}


@dataclass(frozen=True)
class ThreadPlan:
    num_threads: int
    cpus: tuple[int, ...] | None  # bind thread i to cpus[i]; None: no binding
    why: str


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11] (Linux's cpulist format)."""
    cpus: list[int] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not an ascending range")
        cpus.extend(range(first, last + 1))
    if not cpus:
        raise ValueError(f"bad CPU list {text!r}: no CPUs")
    return list(dict.fromkeys(cpus))


def one_cpu_per_core(cpus: list[int]) -> list[int]:
    """The first allowed CPU of each physical core (by sysfs topology)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "core_id") as f:
                core = f.read().strip()
            with open(base + "physical_package_id") as f:
                pkg = f.read().strip()
        except OSError:
            return list(cpus)  # no topology: every CPU counts
        if (pkg, core) not in seen:
            seen.add((pkg, core))
            out.append(cpu)
    return out


def plan_threads(cpu_threads: int | None, bind: str | None, local_rank: int = 0,
                 local_ranks: int = 1, allowed: list[int] | None = None,
                 environ: dict[str, str] | None = None) -> ThreadPlan:
    """The thread count and binding for one engine (pure: tested without threads)."""
    env = os.environ if environ is None else environ
    bind = (bind or env.get(BIND_ENV) or "auto").strip()
    allowed = sorted(os.sched_getaffinity(0)) if allowed is None else allowed
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"cpu_threads must be >= 1, got {cpu_threads}")
    if bind in ("nobind", "all"):
        n = cpu_threads or len(one_cpu_per_core(allowed))
        return ThreadPlan(n, None, f"{BIND_ENV}={bind}: {n} threads, not bound")
    if bind != "auto":
        lists = bind.split("|")
        if local_rank >= len(lists):
            raise ValueError(f"{BIND_ENV}={bind!r} names {len(lists)} CPU list(s) but this is "
                             f"local data-parallel rank {local_rank}")
        cpus = parse_cpu_list(lists[local_rank])
        outside = sorted(set(cpus) - set(allowed))
        if outside:
            raise ValueError(f"{BIND_ENV}={bind!r}: CPUs {outside} are not in this process's "
                             f"affinity mask {allowed}")
        cpus = cpus[:cpu_threads] if cpu_threads else cpus
        return ThreadPlan(len(cpus), tuple(cpus), f"{BIND_ENV}: bound to {cpus}")
    cores = one_cpu_per_core(allowed)
    if len(cores) <= SMALL_MACHINE_CORES * local_ranks:
        per_rank = max(1, len(cores) // local_ranks)
        n = min(cpu_threads or per_rank, per_rank)
        return ThreadPlan(n, None, f"auto: {len(cores)} cores, {n} threads, nothing reserved "
                                   "or bound (small machine)")
    try:
        reserved = int(env.get(RESERVED_ENV, "1"))
    except ValueError:
        raise ValueError(f"{RESERVED_ENV} must be an integer, got {env[RESERVED_ENV]!r}") from None
    if not 0 <= reserved < len(cores):
        raise ValueError(f"{RESERVED_ENV}={reserved} leaves no core of {len(cores)} to compute")
    usable = cores[: len(cores) - reserved]
    per_rank = len(usable) // local_ranks
    if per_rank < 1:
        raise ValueError(f"{len(usable)} cores (after {reserved} reserved) cannot hold "
                         f"{local_ranks} local data-parallel ranks")
    cpus = usable[local_rank * per_rank:(local_rank + 1) * per_rank]
    cpus = cpus[:cpu_threads] if cpu_threads else cpus
    return ThreadPlan(len(cpus), tuple(cpus),
                      f"auto: bound to {cpus}, {reserved} core(s) left to the front-end")


def bind_openmp_threads_py(cpus: list[int]) -> list[int]:
    """Without the extension no code runs on torch's OpenMP workers, so the twin of
    ``_C.bind_openmp_threads`` confines every thread of the process to the set as
    a whole (the kernel still places them); returns the thread ids it set."""
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    done = []
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done.append(tid)
        except OSError:  # the thread ended meanwhile
            pass
    return done


def team_thread_ids_py(num_threads: int) -> list[int]:
    """The twin of ``_C.team_thread_ids``: without the extension nothing runs on
    torch's team members, so only the caller is known (member 0); -1 for the rest."""
    if num_threads < 1:
        raise ValueError("num_threads must be >= 1")
    return [threading.get_native_id()] + [-1] * (num_threads - 1)


def apply_thread_plan(plan: ThreadPlan) -> None:
    """Set torch's intra-op thread count, then bind its team as planned."""
    torch.set_num_threads(plan.num_threads)
    bound = None
    if plan.cpus is not None:
        ext = _native.extension()
        fn = ext.bind_openmp_threads if ext is not None else bind_openmp_threads_py
        bound = fn(list(plan.cpus))
    _applied.update(plan=plan, bound=bound)
    logger.info("CPU threads: %s; wait policy: %s", plan.why, omp_env.describe_wait_policy())


def describe() -> str:
    """This process's thread policy in one line (benchmarks print it)."""
    plan = _applied.get("plan")
    head = plan.why if isinstance(plan, ThreadPlan) else f"{torch.get_num_threads()} threads"
    return f"{head}; wait: {omp_env.describe_wait_policy()}"


def read_runqueue_wait_ns(fds: list[int]) -> int:
    """Sum of the nanoseconds these threads spent runnable but not running (field 2 of
    Linux's /proc/self/task/TID/schedstat, read through open descriptors)."""
    total = 0
    for fd in fds:
        try:
            total += int(os.pread(fd, 64, 0).split()[1])
        except (OSError, IndexError, ValueError):  # the thread ended: it waits no more
            pass
    return total


class StarvationGovernor:
    """torch's own ops on one thread while the compute team is starved.

    With another process busy on one of the team's cores, the member there shares
    its core with that process: every parallel region's join waits whole time slices
    for it. Our kernels notice and run on the calling thread for a while
    (csrc/cpu_threads.cpp), but most of a step is torch's GEMMs (oneDNN, MKL) on the
    same team: on a 2-core AMD EPYC with one core busy the engine fell to 0.16x of its
    idle decode rate, against 0.74x with one thread, which the kernel then places on
    the free core (docs/benchmarks.md). The signal is the kernel's own: the time the
    team's threads spent runnable but waiting for a CPU (schedstat), over the wall
    time since the last step. Idle it is ~0; with a busy neighbour ~0.5 (p10 0.45);
    with our own API server beside the engine at concurrency 32, p50 0.15, p90 0.28,
    a load where the team still beats one thread (docs/benchmarks.md). Three steps in
    a row over ``THRESHOLD`` start a spell: torch gets one thread for ``FIRST_SPELL_S``
    (doubled for each spell that starts as soon as the strikes allow after the last
    one's end, i.e. within ``STRIKES + 1`` judged steps, up to ``MAX_SPELL_S``;
    counted in steps, so slow steps still back off), then its team back, and the next
    steps judge it again.

    Called before each step on the thread that runs the model (torch's OpenMP thread
    count is per thread). ``wait_ns`` / ``clock`` are injectable for tests; by default
    the team's threads are read in /proc (the team from ``_C.team_thread_ids``; on the
    pure-Python path every thread of the process, which only adds threads that sleep).
    Without /proc schedstat (another OS, a kernel without CONFIG_SCHED_INFO) the
    governor stays off.
    """

    THRESHOLD = 0.35
    STRIKES = 3
    FIRST_SPELL_S = 0.5
    MAX_SPELL_S = 8.0

    def __init__(self, num_threads: int, wait_ns=None, clock=time.monotonic) -> None:
        self.num_threads = num_threads
        self.clock = clock
        self._wait_ns = wait_ns
        self._fds: list[int] = []
        self.serial = False
        self.spells = 0
        self._strikes = 0
        self._spell_s = self.FIRST_SPELL_S
        self._spell_end = 0.0
        self._judged_since_retry = 1 << 30
        self._last: tuple[float, int] | None = None

    def _open_team(self) -> bool:
        ext = _native.extension()
        if ext is not None:
            tids = [t for t in ext.team_thread_ids(self.num_threads) if t > 0]
        else:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        for tid in tids:
            try:
                self._fds.append(os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY))
            except OSError:
                pass
        return bool(self._fds)

    def _read(self) -> int:
        if self._wait_ns is not None:
            return self._wait_ns()
        return read_runqueue_wait_ns(self._fds)

    def before_step(self) -> None:
        if self.num_threads <= 1:
            return
        if self._wait_ns is None and not self._fds and not self._open_team():
            self.num_threads = 1  # nothing to read: stay off
            return
        now, waited = self.clock(), self._read()
        last, self._last = self._last, (now, waited)
        if self.serial:
            if now >= self._spell_end:  # try the team again
                self.serial = False
                self._judged_since_retry = 0
                self._last = None
                torch.set_num_threads(self.num_threads)
            return
        if last is None or now <= last[0]:
            return
        share = (waited - last[1]) / 1e9 / (now - last[0])
        self._judged_since_retry += 1
        self._strikes = self._strikes + 1 if share > self.THRESHOLD else 0
        if self._strikes < self.STRIKES:
            return
        self._strikes = 0
        self.serial = True
        self.spells += 1
        # Starved again right after a retry: the neighbour stays, retry less often.
        quick = self._judged_since_retry <= self.STRIKES + 1
        self._spell_s = min(2 * self._spell_s, self.MAX_SPELL_S) if quick else self.FIRST_SPELL_S
        self._spell_end = now + self._spell_s
        torch.set_num_threads(1)
        (logger.info if self.spells == 1 else logger.debug)(
            "CPU threads: the compute team waited %.0f %% of the time for a CPU (another "
            "process is busy on its cores): torch runs on one thread for %.1f s (spell %d; "
            f"{GOVERNOR_ENV}=0 turns this off)",
            100 * share, self._spell_s, self.spells)

    def close(self) -> None:
        """Stop: torch gets its team back (set_num_threads is also the default of
        threads started later), the descriptors are closed, nothing is read again."""
        if self.serial:
            self.serial = False
            torch.set_num_threads(self.num_threads)
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self.num_threads = 1  # before_step is a no-op from now on


def starvation_governor() -> StarvationGovernor | None:
    """The governor for this process's applied thread plan (None: no plan applied,
    i.e. not a CPU engine, or a single compute thread)."""
    plan = _applied.get("plan")
    if not isinstance(plan, ThreadPlan) or plan.num_threads <= 1:
        return None
    if os.environ.get(GOVERNOR_ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    return StarvationGovernor(plan.num_threads)
