"""vLLM v1's scheduler step at 1 / 64 / 256 decodes, for the ratio against ours.

A plain script (not a pytest module: vLLM is never a dependency of enginecore);
run it with a Python that has vLLM, e.g. the CPU build in its own venv:

    flock /tmp/ec-suite.lock flock /tmp/ec-bench.lock \\
        /tmp/vllm-venv/bin/python bench/bench_vllm_scheduler.py

It builds vLLM's real ``vllm.v1.core.sched.scheduler.Scheduler`` the way vLLM's
EngineCore does (and its tests/v1/core/utils.py ``create_scheduler``): a
VllmConfig whose ModelConfig reads a tiny Llama config.json written to a temp
dir (no tokenizer, no weights, no network), a KVCacheConfig with one
FullAttentionSpec group of block size 16 and as many blocks as our
bench/bench_engine_core.py engine gets (524,288), prefix caching on with the
configured hash, max_num_seqs >= N, max_num_batched_tokens = max(8192, N).

Requests are shaped as in bench/bench_engine_core.py ``decoding_engine``: 32
random prompt tokens (random.Random(0)), SamplingParams(max_tokens=60000,
ignore_eos=True, seed=i); steps run until every request has an output token.
Then one timed step is what vLLM's EngineCore.step does around a model that
costs nothing:

    schedule() -> get_grammar_bitmask() -> a ModelRunnerOutput with one sampled
    token per scheduled request -> update_from_output()

Not included (and not in ours either): the executor RPC, detokenization, the
output queue / serialization. Our EngineCore.step also runs the synthetic
executor (one splitmix64 per request) and its own step wrapper; here the
"model" is one getrandbits per request.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

BLOCK_SIZE = 16
NUM_BLOCKS = 524288  # what EngineArgs(kv_cache_memory_bytes=16 GiB) gives ours
MAX_MODEL_LEN = 1 << 16
PROMPT_LEN = 32
VOCAB = 32000

# A tiny Llama: the scheduler reads only shapes and limits from the model config.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
    "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": VOCAB,
    "max_position_embeddings": MAX_MODEL_LEN, "rms_norm_eps": 1e-5,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


def build_scheduler(model_dir: str, num_reqs: int, log_stats: bool):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_batched = max(8192, num_reqs)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max(num_reqs, 1), max_num_batched_tokens=max_batched,
        max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True, async_scheduling=False,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0,
                               skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=torch.float32))],
    )
    cache_config.num_gpu_blocks = NUM_BLOCKS
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler = Scheduler(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size, hash_block_size=hash_block_size, log_stats=log_stats,
    )
    return scheduler, vllm_config, hash_block_size


def block_hasher(vllm_config, hash_block_size: int):
    """As vLLM's EngineCore builds it when prefix caching is on."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(hash_block_size, hash_fn)


class DecodingStep:
    """One vLLM engine step with a zero-latency model (what EngineCore.step does)."""

    def __init__(self, scheduler):
        from vllm.v1.outputs import ModelRunnerOutput

        self.scheduler = scheduler
        self.output_cls = ModelRunnerOutput
        self.rng = random.Random(1)

    def model(self, scheduler_output):
        req_ids = list(scheduler_output.num_scheduled_tokens)
        bits = self.rng.getrandbits
        return self.output_cls(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[bits(15)] for _ in req_ids],
        )

    def __call__(self):
        scheduler = self.scheduler
        scheduler_output = scheduler.schedule()
        scheduler.get_grammar_bitmask(scheduler_output)
        model_output = self.model(scheduler_output)
        outputs = scheduler.update_from_output(scheduler_output, model_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0


def decoding_step(model_dir: str, num_reqs: int, log_stats: bool) -> DecodingStep:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    scheduler, vllm_config, hash_block_size = build_scheduler(model_dir, num_reqs, log_stats)
    hasher = block_hasher(vllm_config, hash_block_size)
    rng = random.Random(0)
    for i in range(num_reqs):
        prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]
        params = SamplingParams(max_tokens=60000, ignore_eos=True, seed=i)
        scheduler.add_request(Request(f"req-{i}", prompt, params, None, block_hasher=hasher))
    step = DecodingStep(scheduler)
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):
        step()
    return step


def time_step(step: DecodingStep, num_reqs: int, max_time: float, min_rounds: int,
              warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times: list[float] = []
    clock = time.perf_counter
    deadline = clock() + max_time
    while len(times) < min_rounds or clock() < deadline:
        t0 = clock()
        outputs, executed = step()
        times.append(clock() - t0)
        assert executed and len(outputs[0].outputs) == num_reqs
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-reqs", default="1,64,256", help="decode batch sizes")
    ap.add_argument("--max-time", type=float, default=1.0,
                    help="seconds of timed steps per case (pytest-benchmark's default)")
    ap.add_argument("--min-rounds", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    ap.add_argument("--log-stats", choices=["off", "on", "both"], default="both",
                    help="Scheduler(log_stats=...): off is like our bench (no stat "
                         "logger); on is vLLM serve's default")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    try:
        import vllm
    except ImportError:
        print("vLLM is not installed in this Python; run with vLLM's venv", file=sys.stderr)
        return 2
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.log_stats]
    results = []
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        for n in (int(x) for x in args.num_reqs.split(",")):
            for log_stats in modes:
                step = decoding_step(model_dir, n, log_stats)
                times = time_step(step, n, args.max_time, args.min_rounds, args.warmup)
                results.append({"num_reqs": n, "log_stats": log_stats, "rounds": len(times),
                                "min_us": min(times) * 1e6,
                                "median_us": statistics.median(times) * 1e6})
                del step
                gc.collect()
    print(f"\nvLLM {vllm.__version__} v1 Scheduler step (schedule + grammar bitmask + "
          "ModelRunnerOutput + update_from_output), all requests decoding")
    print(f"{'decodes':>8} {'log_stats':>9} {'min us':>10} {'median us':>10} {'rounds':>7}")
    for r in results:
        print(f"{r['num_reqs']:>8} {r['log_stats']!s:>9} {r['min_us']:>10.1f} "
              f"{r['median_us']:>10.1f} {r['rounds']:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vllm": vllm.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
