"""The offline ``LLM`` as vLLM users call it (tiny model, engine in process unless
said): LoRA per prompt, chat with LoRA and template kwargs, sleep / wake_up,
prefix-cache reset, profiling, collective_rpc, metrics in vLLM's reader shape
(spec-decode acceptance included), aborted requests counted."""

from __future__ import annotations

import json
import os

import pytest

from enginecore import LLM, EngineArgs, LoRARequest, SamplingParams
from enginecore.frontend.metrics_reader import Counter, Gauge, Histogram, Vector
from test_lora import make_adapter

GREEDY = dict(temperature=0, ignore_eos=True)


def make_llm(model: str, **kw) -> LLM:
    args = dict(multiprocess_mode=False, max_model_len=128, kv_cache_memory_bytes=8 << 20,
                dtype="float32")
    args.update(kw)
    return LLM(model, **args)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def adapter(tiny_chat_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("llm-lora") / "a")
    return LoRARequest("a", 1, make_adapter(tiny_chat_model, out, 3, ["q_proj", "v_proj"]))


def test_top_level_imports():
    import enginecore
    from enginecore import LLM as top_llm
    from enginecore import SamplingParams as top_sp

    assert top_llm is LLM and "LLM" in enginecore.__all__ and top_sp is SamplingParams


def test_lora_request_one_or_one_per_prompt(tiny_chat_model, adapter, hot_path):
    sp = SamplingParams(max_tokens=8, **GREEDY)
    prompts = ["héllo", "wörld"]
    with make_llm(tiny_chat_model, enable_lora=True, max_lora_rank=8) as llm:
        base = tokens(llm.generate(prompts, sp, use_tqdm=False))
        with_a = tokens(llm.generate(prompts, sp, use_tqdm=False, lora_request=adapter))
        assert with_a != base  # the adapter changes the greedy tokens
        mixed = tokens(llm.generate(prompts, sp, use_tqdm=False,
                                    lora_request=[None, adapter]))
        assert mixed == [base[0], with_a[1]]
        # A prompt dict's own lora_request is used, not dropped.
        own = tokens(llm.generate([{"prompt": "héllo", "lora_request": adapter}], sp,
                                  use_tqdm=False))
        assert own == [with_a[0]]
        outs = llm.generate("héllo", sp, use_tqdm=False, lora_request=adapter)
        assert outs[0].lora_request == adapter
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate(prompts, sp, use_tqdm=False, lora_request=[adapter])
        with pytest.raises(ValueError, match="differs from the lora_request argument"):
            llm.generate([{"prompt": "x", "lora_request": adapter}], sp, use_tqdm=False,
                         lora_request=LoRARequest("b", 2, adapter.lora_path))
        chat = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False,
                        lora_request=adapter, chat_template_kwargs={"unused": True})
        plain_chat = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False)
        assert chat[0].lora_request == adapter and chat[0].prompt == plain_chat[0].prompt
        assert tokens(chat) != tokens(plain_chat)


def test_sleep_wake_reset_rpc_and_profile(tiny_chat_model, tmp_path):
    sp = SamplingParams(max_tokens=6, **GREEDY)
    prompt = {"prompt_token_ids": list(range(5, 45))}
    with make_llm(tiny_chat_model, enable_sleep_mode=True, block_size=16,
                  profiler_dir=str(tmp_path / "traces")) as llm:
        first = llm.generate(prompt, sp, use_tqdm=False)
        assert llm.generate(prompt, sp, use_tqdm=False)[0].num_cached_tokens == 32
        assert llm.reset_prefix_cache() is True
        assert llm.generate(prompt, sp, use_tqdm=False)[0].num_cached_tokens == 0
        assert llm.is_sleeping() is False
        llm.sleep(level=1)
        assert llm.is_sleeping() is True
        llm.wake_up(["weights"])
        llm.wake_up(["kv_cache"])
        assert llm.is_sleeping() is False
        assert tokens(llm.generate(prompt, sp, use_tqdm=False)) == tokens(first)
        assert llm.collective_rpc("echo", args=("ping",)) == ["ping"]
        with pytest.raises(Exception, match="not allowed"):
            llm.collective_rpc("load_model")
        llm.start_profile()
        llm.generate(prompt, sp, use_tqdm=False)
        llm.stop_profile()
        (trace,) = os.listdir(tmp_path / "traces")
        with open(tmp_path / "traces" / trace) as f:
            assert json.load(f)["traceEvents"]
    with make_llm(tiny_chat_model) as llm, pytest.raises(Exception, match="profiler is off"):
        llm.start_profile()


def test_get_metrics_in_vllm_reader_shape(tiny_chat_model, hot_path):
    from prometheus_client import CollectorRegistry

    with make_llm(tiny_chat_model, disable_log_stats=False, num_speculative_tokens=3,
                  prompt_lookup_min=1, max_model_len=256) as llm:
        llm.metrics = type(llm.metrics)(llm.config.model_config.model, CollectorRegistry())
        prompt = {"prompt_token_ids": [5, 6, 7, 8] * 6}
        outs = llm.generate([prompt, "héllo"], SamplingParams(max_tokens=20, **GREEDY),
                            use_tqdm=False)
        metrics = llm.get_metrics()
    by_name: dict[str, list] = {}
    for m in metrics:
        by_name.setdefault(m.name, []).append(m)
        assert m.name.startswith("enginecore:") and isinstance(m.labels, dict)
    gen = by_name["enginecore:generation_tokens"]
    assert isinstance(gen[0], Counter) and gen[0].value == 40
    assert gen[0].labels == {"model_name": llm.config.model_config.model}
    (success,) = by_name["enginecore:request_success"]
    assert success.labels["finished_reason"] == "length" and success.value == 2
    ttft = by_name["enginecore:time_to_first_token_seconds"][0]
    assert isinstance(ttft, Histogram) and ttft.count == 2 and ttft.sum > 0
    assert ttft.buckets["+Inf"] == 2 and list(ttft.buckets.values()) == sorted(
        ttft.buckets.values())
    assert isinstance(by_name["enginecore:kv_cache_usage_perc"][0], Gauge)
    drafts = by_name["enginecore:spec_decode_num_draft_tokens"][0].value
    accepted = by_name["enginecore:spec_decode_num_accepted_tokens"][0].value
    assert drafts > 0 and accepted > 0
    assert by_name["enginecore:spec_decode_num_drafts"][0].value > 0
    (per_pos,) = by_name["enginecore:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and sum(per_pos.values) == accepted
    assert len(per_pos.values) <= 3 and per_pos.values == sorted(per_pos.values, reverse=True)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)


def test_aborts_are_counted(tiny_chat_model, aloop):
    from prometheus_client import CollectorRegistry

    from enginecore import AsyncLLM
    from enginecore.frontend.metrics import FrontendMetrics
    from enginecore.frontend.metrics_reader import get_metrics_snapshot
    from enginecore.sampling_params import RequestOutputKind

    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=tiny_chat_model, max_model_len=128, kv_cache_memory_bytes=8 << 20))
    registry = CollectorRegistry()
    engine.metrics = FrontendMetrics(engine.model_config.model, registry)

    async def abort_midway():
        sp = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, **GREEDY)
        outs = []
        async for out in engine.generate("héllo", sp, "ab1"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("ab1")
        return outs

    try:
        outs = aloop.run(abort_midway())
        assert outs[-1].outputs[0].finish_reason == "abort"
    finally:
        aloop.run(_shutdown(engine))
    success = [m for m in get_metrics_snapshot(registry)
               if m.name == "enginecore:request_success"]
    assert [(m.labels["finished_reason"], m.value) for m in success] == [("abort", 1)]


async def _shutdown(engine):
    engine.shutdown()


def test_priority_per_prompt(tiny_chat_model):
    sp = SamplingParams(max_tokens=2, **GREEDY)
    with make_llm(tiny_chat_model, scheduling_policy="priority") as llm:
        outs = llm.generate(["a", "b"], sp, use_tqdm=False, priority=[1, -1])
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
        with pytest.raises(TypeError, match="one value per prompt"):
            llm.generate(["a", "b"], sp, use_tqdm=False, priority=1)
    with make_llm(tiny_chat_model) as llm, pytest.raises(ValueError, match="priority"):
        llm.generate(["a"], sp, use_tqdm=False, priority=[3])
