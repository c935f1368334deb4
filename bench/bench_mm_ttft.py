"""TTFT of an image prompt through EngineCore with a cold vs a warm encoder cache
(tiny random Qwen2-VL; prefix caching off, so the warm run reuses only the
encoder output). Short: `python bench/bench_mm_ttft.py` (prints lscpu's model)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from enginecore import EngineArgs, EngineCore
from test_mm_engine_qwen2_vl import PROMPT_ONE, request
from tiny_qwen2_vl import make_tiny_qwen2_vl, random_image


def ttft(eng: EngineCore, req) -> float:
    t0 = time.perf_counter()
    eng.add_request(req)
    while True:
        outs, _ = eng.step()
        if any(o.new_token_ids for c in outs.values() for o in c.outputs):
            dt = time.perf_counter() - t0
            break
    while eng.scheduler.has_requests():
        eng.step()
    return dt


def main() -> None:
    print(subprocess.run(["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True,
                         check=False, text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_qwen2_vl(d)
        eng = EngineCore(EngineArgs(model=model, dtype="float32", max_model_len=512,
                                    enable_prefix_caching=False, num_gpu_blocks_override=256,
                                    max_num_batched_tokens=512).create_engine_config())
        image = random_image(224, 224, seed=0)
        cold, warm = [], []
        for i in range(5):
            eng.reset_encoder_cache()
            cold.append(ttft(eng, request(model, f"c{i}", PROMPT_ONE, [image])[0]))
            warm.append(ttft(eng, request(model, f"w{i}", PROMPT_ONE, [image])[0]))
        c, w = sorted(cold)[2], sorted(warm)[2]
        print(f"TTFT median cold {c * 1e3:.1f} ms, warm {w * 1e3:.1f} ms, cold/warm {c / w:.2f}x")


if __name__ == "__main__":
    main()
