"""N-gram speculative decoding on the default model: a repetitive prompt
(a list to repeat) at batch 1, 8 and 32, with and without speculation.

Run: pytest bench/bench_spec_decode.py --benchmark-group-by=group -s
"""

from __future__ import annotations

import time

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.model.tokenizer import Tokenizer

OUTPUT_LEN = 96
TEXT = ("Repeat this list exactly three times: apple, banana, cherry, date, elderberry, "
        "fig, grape, honeydew, kiwi, lemon.")


def run(batch: int, k: int) -> tuple[int, float, float]:
    eng = EngineCore(EngineArgs(max_model_len=1024, kv_cache_memory_bytes=512 << 20,
                                num_speculative_tokens=k,
                                prompt_lookup_min=2).create_engine_config())
    tok = Tokenizer.from_dir(eng.config.model_config.model_path)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": TEXT}]),
                     add_special_tokens=False)
    for i in range(batch):
        eng.add_request(EngineCoreRequest(str(i), ids, SamplingParams(
            max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)))
    t0 = time.perf_counter()
    n = 0
    while eng.scheduler.has_requests():
        outputs, executed = eng.step()
        eng.post_step(executed)
        for outs in outputs.values():
            for o in outs.outputs:
                n += len(o.new_token_ids)
    elapsed = time.perf_counter() - t0
    stats = eng.scheduler.make_stats()
    rate = (stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
            if stats.spec_num_draft_tokens else 0.0)
    return n, n / elapsed, rate


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("k", [0, 4])
def test_spec_decode(benchmark, batch, k):
    benchmark.group = f"spec_decode[batch {batch}]"
    result = {}

    def once():
        result["r"] = run(batch, k)

    benchmark.pedantic(once, rounds=1, iterations=1)
    n, tps, rate = result["r"]
    benchmark.extra_info.update(tokens_per_s=round(tps, 1), acceptance_rate=round(rate, 3))
    print(f"\nbatch {batch} k={k}: {tps:.1f} tokens/s, acceptance {rate:.2f}")
    assert n == batch * OUTPUT_LEN
