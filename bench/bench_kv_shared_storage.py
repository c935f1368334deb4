"""TTFT of a long prompt on a warm shared KV store vs cold (issue 20's acceptance: >= 10x).

Each measurement is a fresh EngineCore on the default model (start-up not counted): cold
= an empty store directory, so the engine computes the whole prompt (and stores it);
warm = a fresh engine on the directory a previous engine wrote, so it loads every full
block and computes only the last partial one. Rounds alternate cold / warm in one run.

    .venv/bin/python bench/bench_kv_shared_storage.py --prompt-tokens 4096 --rounds 2
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import tempfile
import time

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def engine_on(store: str, max_len: int) -> EngineCore:
    kv = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": store}}
    args = EngineArgs(max_model_len=max_len, kv_transfer_config=kv)
    return EngineCore(args.create_engine_config())


def ttft(engine: EngineCore, prompt: list[int], rid: str) -> tuple[float, int]:
    """Seconds from add_request to the first sampled token, and num_cached_tokens."""
    start = time.perf_counter()
    engine.add_request(EngineCoreRequest(rid, prompt, SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True)))
    while True:
        outputs, _ = engine.step()
        for outs in outputs.values():
            for o in outs.outputs:
                if o.new_token_ids:
                    elapsed = time.perf_counter() - start
                    while engine.scheduler.has_requests():
                        engine.step()
                    return elapsed, o.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(f"CPU: {cpu_model()}")
    cold, warm = [], []
    for r in range(a.rounds):
        prompt = random.Random(r).choices(range(100, 40000), k=a.prompt_tokens)
        with tempfile.TemporaryDirectory() as store:
            e = engine_on(store, a.prompt_tokens + 64)
            t, cached = ttft(e, prompt, f"cold{r}")
            e.shutdown()
            cold.append(t)
            print(f"round {r}: cold TTFT {t * 1e3:8.1f} ms (cached {cached})")
            e = engine_on(store, a.prompt_tokens + 64)
            t, cached = ttft(e, prompt, f"warm{r}")
            e.shutdown()
            warm.append(t)
            print(f"round {r}: warm TTFT {t * 1e3:8.1f} ms (cached {cached})")
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"median cold {c * 1e3:.1f} ms, warm {w * 1e3:.1f} ms: {c / w:.1f}x lower warm")


if __name__ == "__main__":
    main()
