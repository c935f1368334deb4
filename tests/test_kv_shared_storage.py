"""SharedStorageConnector: a prompt's KV outlives its engine (issue 20's acceptance).

Engine A computes a 1,000+ token prompt and stores its blocks; a fresh engine B on the
same directory (and A after a restart) loads them: identical greedy tokens (transformers
is the reference), and the prompt tokens computed are at most the last partial block.
A directory written for another model or block size is refused.
"""

from __future__ import annotations

import os
import random

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.protocol import FinishReason
from tiny_models import hf_greedy, make_tiny_chat_model, make_tiny_model

BLOCK = 16
MAX_TOKENS = 6
PROMPT = random.Random(7).choices(range(3, 256), k=1037)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("llama_long")), "llama",
                           max_position_embeddings=2048)


def make_engine(model: str, store: str, block_size: int = BLOCK, **extra) -> EngineCore:
    policy = extra.pop("kv_load_failure_policy", "recompute")
    kv = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
          "kv_load_failure_policy": policy,
          "kv_connector_extra_config": {"shared_storage_path": store, **extra}}
    args = EngineArgs(model=model, dtype="float32", block_size=block_size,
                      num_gpu_blocks_override=160, max_model_len=2048,
                      log_iteration_details=True, kv_transfer_config=kv)
    return EngineCore(args.create_engine_config())


def run(engine: EngineCore, prompt: list[int], rid: str = "r") -> dict:
    """Greedy tokens, the finish output and the prompt tokens the engine computed."""
    engine.add_request(EngineCoreRequest(rid, prompt, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))
    got = {"tokens": [], "prefill_tokens": 0, "final": None}
    for _ in range(1000):
        if not engine.scheduler.has_requests():
            return got
        outputs, _ = engine.step()
        details = engine.scheduler.last_iteration
        if details is not None:
            got["prefill_tokens"] += details.num_prefill_tokens
            engine.scheduler.last_iteration = None
        for outs in outputs.values():
            for o in outs.outputs:
                got["tokens"] += o.new_token_ids
                if o.finished:
                    got["final"] = o
    raise AssertionError("engine did not finish")


def test_second_engine_and_restart_load_the_prompt(long_llama, tmp_path, hot_path):
    store = str(tmp_path / "kv")
    expected = hf_greedy(long_llama, PROMPT, MAX_TOKENS)
    a = make_engine(long_llama, store)
    first = run(a, PROMPT)
    assert first["tokens"] == expected
    assert first["final"].num_cached_tokens == 0
    assert first["prefill_tokens"] == len(PROMPT)
    a.shutdown()
    del a
    full_blocks = (len(PROMPT) - 1) // BLOCK
    files = [f for _, _, fs in os.walk(store) for f in fs if f.endswith(".kvblock")]
    assert len(files) == len(PROMPT) // BLOCK  # every full prompt block, once

    for _ in ("fresh engine B", "A restarted"):
        b = make_engine(long_llama, store)
        second = run(b, PROMPT)
        assert second["tokens"] == expected
        assert second["final"].num_cached_tokens == full_blocks * BLOCK
        assert second["prefill_tokens"] == len(PROMPT) - full_blocks * BLOCK <= BLOCK
        stats = b.scheduler.make_stats()
        assert stats.num_external_computed_tokens == full_blocks * BLOCK
        b.shutdown()


def test_another_model_or_block_size_is_refused(long_llama, tmp_path, tmp_path_factory):
    store = str(tmp_path / "kv")
    run(make_engine(long_llama, store), PROMPT[:100])
    with pytest.raises(ValueError, match="block_size 16.*block_size 8|another engine setup"):
        make_engine(long_llama, store, block_size=8)
    other = make_tiny_model(str(tmp_path_factory.mktemp("other")), "llama", seed=3,
                            max_position_embeddings=2048)
    with pytest.raises(ValueError, match="another engine setup"):
        make_engine(other, store)


def _corrupt_one_block(store: str) -> None:
    path = next(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs
                if f.endswith(".kvblock"))
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"garbage!")


def test_a_bad_block_file_is_recomputed_or_fails(long_llama, tmp_path, hot_path):
    store = str(tmp_path / "kv")
    prompt = PROMPT[:300]
    expected = hf_greedy(long_llama, prompt, MAX_TOKENS)
    run(make_engine(long_llama, store), prompt)
    _corrupt_one_block(store)
    recomputed = run(make_engine(long_llama, store), prompt)
    assert recomputed["tokens"] == expected
    _corrupt_one_block(store)
    failed = run(make_engine(long_llama, store, kv_load_failure_policy="fail"), prompt)
    assert failed["final"].finish_reason == FinishReason.ERROR
    assert "could not be loaded" in failed["final"].stop_reason


def test_size_cap_evicts_least_recently_used(long_llama, tmp_path):
    store = str(tmp_path / "kv")
    engine = make_engine(long_llama, store)
    block_file = engine.scheduler.connector.identity.payload_bytes
    cap = 12 * block_file + 12 * 512
    engine = make_engine(long_llama, store, max_bytes=cap)
    prompt = PROMPT[:400]  # 25 blocks: more than the cap holds
    first = run(engine, prompt)
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs
             if f.endswith(".kvblock")]
    assert 0 < len(sizes) and sum(sizes) <= cap
    # What is left is still right to load.
    assert run(make_engine(long_llama, store, max_bytes=cap), prompt)["tokens"] == \
        first["tokens"] == hf_greedy(long_llama, prompt, MAX_TOKENS)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_llm_api_reports_loaded_tokens_as_cached(tmp_path_factory, tmp_path, multiprocess):
    from enginecore import LLM

    long_llama = make_tiny_chat_model(str(tmp_path_factory.mktemp("chat_long")),
                                      max_position_embeddings=2048)
    kv = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    prompt = PROMPT[:200]
    results = []
    for _ in range(2):  # the second LLM is a fresh engine on the same store
        with LLM(long_llama, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=64,
                 max_model_len=2048, kv_transfer_config=kv,
                 multiprocess_mode=multiprocess) as llm:
            out = llm.generate({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            results.append(out[0])
    assert [r.outputs[0].token_ids for r in results] == [hf_greedy(long_llama, prompt, 4)] * 2
    assert results[0].num_cached_tokens == 0
    assert results[1].num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
