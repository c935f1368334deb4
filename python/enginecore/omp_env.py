"""OpenMP's wait policy for the engine's compute threads, set before torch loads it.

torch's CPU wheel runs its intra-op threads (and, through csrc/cpu_threads.cpp,
our kernels) on libgomp. libgomp reads its wait policy once, when it loads, from
the environment: unset, a thread that finishes its share of a parallel region
spins for GOMP's default 300,000 rounds (milliseconds on current cores) before
it sleeps. On a machine where another process holds a core, the spinning
threads burn the share the late thread needed, and every one of the hundreds
of parallel regions in a step waits for a whole scheduler time slice: the
engine ran at a tenth of its idle speed. A bounded spin waits for a late
thread for a few microseconds (the gap between two regions of one step), then
sleeps on a futex and gives the core away.

``apply_default_wait_policy()`` runs when ``enginecore`` is imported (which
imports no torch): it sets the policy in this process's environment unless
the user set one, so it holds for the OpenMP runtime loaded later in this
process and for every engine process spawned from it (they inherit the
environment). A process that imported torch before enginecore keeps libgomp's
defaults itself (``policy_effective()`` says so); its engine processes still get
the policy. ``ENGINECORE_CPU_THREAD_POLICY=off`` leaves the environment alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# Spin rounds before a waiting libgomp thread sleeps (one round is a load and a
# `pause`: 25 ns, 64 TSC cycles, measured on the AVX-512 EPYC (Zen 4); Intel's
# server cores since Skylake take ~140 cycles per `pause`): ~5 ms here, ~10 ms
# there, two thirds of libgomp's own 300k. Long enough that the gaps of a serving step (the API
# process and the client taking a core for a moment) are spun through instead
# of paid for with a futex sleep and wake per parallel region: at 20000 rounds,
# serving at c=32 ran 12 % slower and c=1 9 % slower (docs/benchmarks.md, round
# 9). A neighbour that keeps a core busy is the governor's case
# (cpu_threads.StarvationGovernor): it gives torch one thread while the team
# waits for CPU, so the long spin no longer burns a starved peer's share (c=1
# beside a busy process: 0.71 of idle, 0.67 at 20000 rounds).
DEFAULT_GOMP_SPINCOUNT = 200000
# Intel's OpenMP (when someone LD_PRELOADs libiomp5): milliseconds before sleeping,
# as vLLM sets it on CPU.
DEFAULT_KMP_BLOCKTIME = 1

POLICY_SWITCH = "ENGINECORE_CPU_THREAD_POLICY"
# Any of these set by the user: the wait policy is theirs.
USER_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

_state = {"applied": False, "torch_was_loaded": False}


def policy_enabled(environ: MutableMapping[str, str] = os.environ) -> bool:
    return environ.get(POLICY_SWITCH, "on").strip().lower() not in ("0", "off", "false", "no")


def apply_default_wait_policy(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the bounded-spin wait policy in ``environ`` where the user set none;
    returns what was set."""
    if not policy_enabled(environ):
        return {}
    added: dict[str, str] = {}
    if not any(v in environ for v in USER_WAIT_VARS):
        added["GOMP_SPINCOUNT"] = str(DEFAULT_GOMP_SPINCOUNT)
    if "KMP_BLOCKTIME" not in environ:
        added["KMP_BLOCKTIME"] = str(DEFAULT_KMP_BLOCKTIME)
    environ.update(added)
    if environ is os.environ and not _state["applied"]:
        _state["applied"] = True
        _state["torch_was_loaded"] = "torch" in sys.modules
    return added


def policy_effective() -> bool:
    """Whether this process's OpenMP runtime was loaded after the policy was set."""
    return _state["applied"] and not _state["torch_was_loaded"]


def describe_wait_policy(environ: MutableMapping[str, str] = os.environ) -> str:
    """The wait policy libgomp of this process reads (or read), in words."""
    parts = [f"{v}={environ[v]}" for v in (*USER_WAIT_VARS, "KMP_BLOCKTIME") if v in environ]
    text = ", ".join(parts) or "libgomp defaults (spin 300000 rounds)"
    if _state["applied"] and _state["torch_was_loaded"]:
        text += " (set after torch loaded: this process keeps libgomp's defaults)"
    return text
