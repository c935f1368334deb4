"""Throughput at concurrency 1 on an idle machine and with another process busy
on one core, for thread policies side by side in one run (issue 22, item 3).

Run: python bench/bench_contention.py [--tokens 64] [--rounds 2] [--policies default,legacy]

Each measurement is a fresh engine process (the in-process ``EngineCore`` on the
default model, dtype auto (BENCH_DTYPE), one 64-token prompt, greedy), because OpenMP reads its
wait policy once, when torch loads it. Policies:

* ``default``: what the engine does out of the box now (executor/cpu_threads.py);
* ``legacy``: libgomp's own defaults with every thread torch starts (no wait
  policy, no binding): the engine before the thread policy;
* ``spin``: OMP_WAIT_POLICY=ACTIVE (threads spin at every barrier).

Idle and busy runs alternate (A B A B ...), so the ratios come from one run on
one machine; absolute figures on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORKER = r"""
import json, os, sys, time, random
from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
n_tokens = int(sys.argv[1])
eng = EngineCore(EngineArgs(dtype=os.environ.get("BENCH_DTYPE", "auto"), max_model_len=512,
                            kv_cache_memory_bytes=64 << 20).create_engine_config())
rng = random.Random(0)
prompt = [rng.randrange(100, 40000) for _ in range(64)]
def run(tag, n):
    eng.add_request(EngineCoreRequest(tag, prompt, SamplingParams(max_tokens=n, temperature=0,
                                                                  ignore_eos=True)))
    got = 0
    while eng.scheduler.has_requests():
        for outs in eng.step()[0].values():
            for o in outs.outputs:
                got += len(o.new_token_ids)
    return got
run("warm", 8)
t0 = time.perf_counter()
got = run("timed", n_tokens)
dt = time.perf_counter() - t0
import torch
from enginecore.executor import cpu_threads
print(json.dumps({"tok_s": got / dt, "threads": torch.get_num_threads(),
                  "policy": cpu_threads.describe()}))
eng.shutdown()
"""

POLICY_ENV = {
    "default": {},
    "legacy": {"ENGINECORE_CPU_THREAD_POLICY": "off"},
    "spin": {"OMP_WAIT_POLICY": "ACTIVE"},
}
CLEARED = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "KMP_BLOCKTIME",
           "VLLM_CPU_OMP_THREADS_BIND", "ENGINECORE_CPU_THREAD_POLICY")


def cpu_header() -> str:
    try:
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    except OSError:
        return "lscpu: not available"
    lines = [ln for ln in out.splitlines() if ln.startswith(("Model name", "CPU(s):"))]
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    picked = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
              if f" {f}" in flags]
    return "; ".join(ln.split(None, 1)[-1].strip() if ":" not in ln else " ".join(ln.split())
                     for ln in lines) + f"; flags: {' '.join(picked)}"


def measure(policy: str, busy: bool, tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    # A policy is a name above or VAR=VALUE[+VAR=VALUE...] (e.g. GOMP_SPINCOUNT=1000).
    env.update(POLICY_ENV[policy] if policy in POLICY_ENV
               else dict(kv.split("=", 1) for kv in policy.split("+")))
    hog = None
    if busy:
        hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
        time.sleep(0.3)
    try:
        out = subprocess.run([sys.executable, "-c", WORKER, str(tokens)], check=False, env=env,
                             capture_output=True, text=True, timeout=900)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if out.returncode != 0:
        raise RuntimeError(f"{policy} busy={busy}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", default="default,legacy")
    args = ap.parse_args()
    policies = args.policies.split(",")
    print(f"# {cpu_header()}")
    print(f"# c=1, {args.tokens} output tokens per run, {args.rounds} rounds, "
          "busy = `python -c 'while 1: pass'` beside the engine")
    results: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        for policy in policies:
            for busy in (False, True):
                m = measure(policy, busy, args.tokens)
                results.setdefault((policy, busy), []).append(m["tok_s"])
                print(f"round {r} {policy:8s} {'busy' if busy else 'idle'}: "
                      f"{m['tok_s']:6.1f} tok/s  threads={m['threads']}  {m['policy']}",
                      flush=True)
    print("\npolicy    idle tok/s  busy tok/s  busy/idle")
    for policy in policies:
        idle = sorted(results[(policy, False)])[len(results[(policy, False)]) // 2]
        busy = sorted(results[(policy, True)])[len(results[(policy, True)]) // 2]
        print(f"{policy:8s}  {idle:10.1f}  {busy:10.1f}  {busy / idle:8.2f}")
    if "default" in policies and "legacy" in policies:
        a = sorted(results[("default", False)])[len(results[("default", False)]) // 2]
        b = sorted(results[("legacy", False)])[len(results[("legacy", False)]) // 2]
        print(f"idle default / legacy: {a / b:.2f}")


if __name__ == "__main__":
    main()
