"""Memory over many distinct images (issue 21: "nothing leaks"): RSS of the front-end
process and the engine process after every 100 of N requests, each with its own random
image, on a tiny random Qwen2-VL. The sender/receiver caches and the encoder cache are
bounded, so RSS should level off once they fill (a small --mm-cache-mb makes that
quick).

    PYTHONPATH=python:tests .venv/bin/python bench/bench_mm_rss.py --requests 500
"""

from __future__ import annotations

import argparse
import os
import tempfile


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def engine_pids() -> list[int]:
    me = os.getpid()
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def main() -> None:
    from enginecore import LLM, SamplingParams
    from tiny_qwen2_vl import make_tiny_qwen2_vl, random_image

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--mm-cache-mb", type=int, default=16)
    a = ap.parse_args()
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_qwen2_vl(d)
        llm = LLM(model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                  mm_processor_cache_gb=a.mm_cache_mb / 1024)
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0)
            for i in range(a.requests):
                image = random_image(56 + 28 * (i % 3), 84, seed=1000 + i)
                llm.generate({"prompt": f"see {pad} here", "multi_modal_data": {"image": image}},
                             params, use_tqdm=False)
                if (i + 1) % 100 == 0:
                    engines = ", ".join(f"{rss_mb(p):.0f}" for p in engine_pids())
                    print(f"after {i + 1:4d} requests: front-end RSS {rss_mb(os.getpid()):.0f} MB,"
                          f" engine RSS {engines} MB", flush=True)
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
