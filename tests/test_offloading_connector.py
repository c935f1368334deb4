"""OffloadingConnector (issue 20's acceptance): with a KV cache too small for the working
set, a repeated long prefix comes back from the host tier (hit counters), and the
tokens are transformers' greedy tokens, as without offloading."""

from __future__ import annotations

import random
import time

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from tiny_models import hf_greedy, make_tiny_model

BLOCK = 16
MAX_TOKENS = 4
rng = random.Random(11)
LONG = rng.choices(range(3, 256), k=120)  # 7 full blocks and 8 tokens
OTHERS = [rng.choices(range(3, 256), k=120) for _ in range(3)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("offload_llama")), "llama")


def engine(model: str, offload: bool) -> EngineCore:
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"num_cpu_blocks": 64}} if offload else None
    # 12 blocks: one 128-token request at a time; the next prompt evicts the last one.
    args = EngineArgs(model=model, dtype="float32", block_size=BLOCK,
                      num_gpu_blocks_override=12, max_model_len=256,
                      log_iteration_details=True, kv_transfer_config=kv)
    return EngineCore(args.create_engine_config())


def run(core: EngineCore, prompt: list[int], rid: str) -> dict:
    core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))
    got = {"tokens": [], "final": None, "prefill_tokens": 0, "kv_stats": {}}
    # By time, not by step count: while the tier's copier thread loads the prefix, a
    # step schedules nothing and returns at once (a loaded machine once ran 2000 such
    # steps before the copy landed); the engine's own loop waits on its queue there.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not (core.scheduler.has_requests() or core.scheduler.has_schedulable_work()):
            break
        outputs, _ = core.step()
        details = core.scheduler.last_iteration
        if details is not None:
            got["prefill_tokens"] += details.num_prefill_tokens
            core.scheduler.last_iteration = None
        elif not outputs:
            time.sleep(0.001)
        for outs in outputs.values():
            for o in outs.outputs:
                got["tokens"] += o.new_token_ids
                if o.finished:
                    got["final"] = o
    assert got["final"] is not None, "the request did not finish"
    return got


def test_repeated_prefix_comes_back_from_the_host_tier(llama, hot_path):
    expected = hf_greedy(llama, LONG, MAX_TOKENS)
    plain, offloaded = engine(llama, False), engine(llama, True)
    try:
        results = {}
        for name, core in (("plain", plain), ("offload", offloaded)):
            first = run(core, LONG, "a0")
            for i, other in enumerate(OTHERS):  # evict LONG's blocks from the cache
                run(core, other, f"o{i}")
            again = run(core, LONG, "a1")
            results[name] = (first, again)
        for first, again in results.values():
            assert first["tokens"] == expected and again["tokens"] == expected
        # Without the tier the cache lost the prefix: all of it is computed again.
        assert results["plain"][1]["prefill_tokens"] == len(LONG)
        first, again = results["offload"]
        assert first["prefill_tokens"] == len(LONG)
        assert again["prefill_tokens"] == len(LONG) % BLOCK  # 7 blocks from the tier
        assert again["final"].num_cached_tokens == len(LONG) // BLOCK * BLOCK
        tier = offloaded.scheduler.connector.connector_scheduler.tier
        assert tier.stats.hit_blocks == len(LONG) // BLOCK
        assert tier.stats.stored_blocks >= 4 * (len(LONG) // BLOCK)
        assert not offloaded.scheduler.kv_hooks.has_pending()
    finally:
        plain.shutdown()
        offloaded.shutdown()
