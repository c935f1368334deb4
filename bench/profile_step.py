"""Where a decode step goes, at batch 1 / 8 / 32 / 64 on the default model (issue 22,
item 1): torch's profiler over a few decode steps of the in-process engine, with
every native kernel (``enginecore._C``) wrapped in a ``record_function`` of its
name for this run only (the engine itself carries no profiler hooks).

Run: python bench/profile_step.py [--batches 1,8,32,64] [--steps 6] [--dtype auto]

Categories: GEMMs (torch's linear / matmul / oneDNN ops and ``_C.bf16_linear``, the LM
head included),
the native kernels by name, other torch ops, and the rest of the step (Python
orchestration: scheduler, runner bookkeeping, outputs), as shares of the step's
wall time. Prints the CPU model and flags first.
"""

from __future__ import annotations

import argparse
import random
import time
import types

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams, _native

GEMM_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm",
            "mkldnn::_linear_pointwise", "aten::mkldnn_linear")
NATIVE_KERNELS = ("paged_attention", "rms_norm", "rope", "silu_and_mul", "greedy_argmax",
                  "sample_rows", "top_p_rows")
# Native GEMMs (bf16 weights on AVX2-only CPUs; the decode GEMV on AVX512_BF16) count as GEMMs.
NATIVE_GEMMS = ("bf16_linear", "bf16_gemv")


def cpu_header() -> str:
    import subprocess

    out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                  if ln.startswith("Model name")), "?")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    picked = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
              if f" {f}" in flags]
    return f"{model}; flags: {' '.join(picked)}; torch threads {torch.get_num_threads()}"


def wrap_native() -> None:
    """Swap the extension for a module whose kernels run inside record_function."""
    ext = _native._ext
    if ext is None:
        return
    proxy = types.ModuleType("enginecore._C_profiled")
    for name in dir(ext):
        fn = getattr(ext, name)
        if name in NATIVE_KERNELS + NATIVE_GEMMS:
            def wrapped(*a, _fn=fn, _name=name, **k):
                with record_function(f"native::{_name}"):
                    return _fn(*a, **k)
            setattr(proxy, name, wrapped)
        else:
            setattr(proxy, name, fn)
    _native._ext = proxy


def profile_batch(eng: EngineCore, batch: int, steps: int, temperature: float = 0.0,
                  top_p: float = 1.0, top_ops: int = 0) -> dict[str, float]:
    rng = random.Random(batch)
    sp = SamplingParams(max_tokens=steps + 4, temperature=temperature, top_p=top_p,
                        ignore_eos=True)
    for i in range(batch):
        eng.add_request(EngineCoreRequest(f"b{batch}-{i}", [rng.randrange(100, 40000)
                                                            for _ in range(64)], sp))
    for _ in range(2):  # the prefill and a first decode, outside the profile
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall_us = (time.perf_counter() - t0) * 1e6
    while eng.scheduler.has_requests():
        eng.step()
    shares: dict[str, float] = {"gemm": 0.0, "other torch ops": 0.0}
    for k in NATIVE_KERNELS:
        shares[k] = 0.0
    # Top-level ops only (an op's children are inside its own time).
    for evt in prof.events():
        if evt.cpu_parent is not None:
            continue
        name, us = evt.name, evt.cpu_time_total
        if name.removeprefix("native::") in NATIVE_GEMMS:
            shares["gemm"] += us
        elif name.startswith("native::"):
            shares[name.removeprefix("native::")] += us
        elif name in GEMM_OPS:
            shares["gemm"] += us
        else:
            shares["other torch ops"] += us
    shares["python & rest"] = max(wall_us - sum(shares.values()), 0.0)
    if top_ops:  # where "other torch ops" goes: its biggest top-level ops, µs a step
        other: dict[str, float] = {}
        for evt in prof.events():
            if evt.cpu_parent is None and not evt.name.startswith("native::") \
                    and evt.name not in GEMM_OPS:
                other[evt.name] = other.get(evt.name, 0.0) + evt.cpu_time_total / steps
        top = sorted(other.items(), key=lambda kv: -kv[1])[:top_ops]
        print(f"# batch {batch}, other torch ops a step: "
              + ", ".join(f"{n} {us:.0f} µs" for n, us in top))
    shares["step ms"] = wall_us / steps / 1e3
    return shares


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (the fast argmax path); vLLM's default SamplingParams is 1.0")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-ops", type=int, default=0,
                    help="also print the N biggest ops inside 'other torch ops' per batch")
    args = ap.parse_args()
    wrap_native()
    eng = EngineCore(EngineArgs(dtype=args.dtype, max_model_len=512,
                                kv_cache_memory_bytes=512 << 20).create_engine_config())
    print(f"# {cpu_header()}; native: {_native.native_available()}; dtype {args.dtype}; "
          f"temperature {args.temperature}, top_p {args.top_p}")
    rows = {b: profile_batch(eng, b, args.steps, args.temperature, args.top_p, args.top_ops)
            for b in map(int, args.batches.split(","))}
    cols = ["gemm", *NATIVE_KERNELS, "other torch ops", "python & rest"]
    print("| batch | step ms | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for b, s in rows.items():
        total = s["step ms"] * 1e3 * args.steps
        print(f"| {b} | {s['step ms']:.1f} | "
              + " | ".join(f"{100 * s[c] / total:.0f} %" for c in cols) + " |")
    eng.shutdown()


if __name__ == "__main__":
    main()
