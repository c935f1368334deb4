"""EngineArgs: vLLM's spellings (config_aliases.py), unknown keywords, and the one
stats switch (``log_stats`` / vLLM's ``disable_log_stats=False``)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from enginecore import EngineArgs, EngineCore, SamplingParams
from enginecore.client import make_client
from enginecore.config_aliases import ALIASES
from enginecore.executor import SyntheticExecutor
from enginecore.protocol import EngineCoreRequest
from helpers import make_request, run_to_completion

STATS_LOGGER = "enginecore.core.stat_logger"


def test_speculative_config_dict_and_json_map_onto_our_fields():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    for value in (spec, '{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'):
        args = EngineArgs(model="synthetic", speculative_config=value)
        assert (args.speculative_method, args.num_speculative_tokens, args.prompt_lookup_min,
                args.prompt_lookup_max) == ("ngram", 3, 2, 4)
        sc = args.create_engine_config().speculative_config
        assert sc.enabled and (sc.prompt_lookup_min, sc.prompt_lookup_max) == (2, 4)


def test_speculative_config_lookup_bounds_follow_vllm():
    """vLLM: one bound given, the other takes its value; none given, 5 and 5."""
    def bounds(**spec):
        a = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                           **spec})
        return a.prompt_lookup_min, a.prompt_lookup_max

    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_max=3) == (3, 3)
    assert bounds(prompt_lookup_min=3) == (3, 3)


@pytest.mark.parametrize("spec, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "only proposer is 'ngram'"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"\['model'\]"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
])
def test_speculative_config_errors_are_clear(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=spec)


def test_renames_and_inversions():
    assert EngineArgs(disable_log_stats=False).log_stats is True
    assert EngineArgs(disable_log_stats=True).log_stats is False
    assert EngineArgs(enable_logging_iteration_details=True).log_iteration_details is True
    assert EngineArgs(async_scheduling=True).max_concurrent_batches == 2
    assert EngineArgs(async_scheduling=False).max_concurrent_batches == 1
    assert EngineArgs(async_scheduling=None).max_concurrent_batches == 1


def test_vllm_none_means_our_default():
    """vLLM passes None for values it decides itself."""
    args = EngineArgs(model="synthetic", seed=None, block_size=None, max_num_seqs=None,
                      enable_prefix_caching=None, enable_chunked_prefill=None,
                      data_parallel_rank=None, data_parallel_address=None,
                      data_parallel_rpc_port=None, data_parallel_start_rank=None)
    assert args == EngineArgs(model="synthetic")


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1.*data_parallel_size"),
    ({"pipeline_parallel_size": 4}, "pipeline_parallel_size must be 1"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be 'auto'"),
    ({"quantization": "awq"}, "quantization is not supported"),
    ({"enable_expert_parallel": True}, "enable_expert_parallel is not supported"),
    ({"model": "a", "tokenizer": "b"}, "separate tokenizer is not supported"),
])
def test_knobs_we_have_at_one_value_only(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)


def test_accepted_knobs_and_their_warnings(caplog):
    with caplog.at_level(logging.WARNING, logger="enginecore.config_aliases"):
        args = EngineArgs(model="synthetic", tensor_parallel_size=1, pipeline_parallel_size=1,
                          enable_sleep_mode=True, enforce_eager=True, trust_remote_code=False,
                          swap_space=4, distributed_executor_backend="mp", kv_cache_dtype="auto",
                          tokenizer="synthetic", max_logprobs=20)
        assert args == EngineArgs(model="synthetic") and not caplog.records
        EngineArgs(trust_remote_code=True, swap_space=16, cpu_offload_gb=2,
                   distributed_executor_backend="ray")
    text = caplog.text
    assert "trust_remote_code" in text and "swap_space" in text and "cpu_offload_gb" in text
    assert "data_parallel_backend='ray'" in text


def test_gpu_memory_utilization_on_cpu_is_warned(caplog, tmp_path):
    """Warned before the model is even looked at."""
    with caplog.at_level(logging.WARNING, logger="enginecore.config"):
        with pytest.raises(FileNotFoundError):
            EngineArgs(model=str(tmp_path / "none"), device="cpu",
                       gpu_memory_utilization=0.5).create_engine_config()
    assert "gpu_memory_utilization=0.5 has no effect on CPU" in caplog.text


def test_alias_disagreeing_with_an_explicit_field_is_an_error():
    with pytest.raises(ValueError, match="num_speculative_tokens=2 and speculative_config"):
        EngineArgs(num_speculative_tokens=2,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="log_stats=False and disable_log_stats=False"):
        EngineArgs(log_stats=False, disable_log_stats=False)
    # Agreeing is fine.
    assert EngineArgs(log_stats=True, disable_log_stats=False).log_stats


def test_unknown_keyword_names_the_closest_field():
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        EngineArgs(max_num_seq=4)
    with pytest.raises(TypeError, match="did you mean 'speculative_config'"):
        EngineArgs(speculative_cfg={})
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'; the fields are"):
        EngineArgs(zzz=1)
    with pytest.raises(TypeError, match="only positional argument"):
        EngineArgs("a", "b")


def test_positional_model_replace_and_equality():
    args = EngineArgs("synthetic", max_num_seqs=3)
    assert args.model == "synthetic" and args.max_num_seqs == 3
    assert dataclasses.replace(args, block_size=4) == EngineArgs("synthetic", max_num_seqs=3,
                                                                 block_size=4)


def test_every_alias_has_help_and_a_flag_kind():
    for name, alias in ALIASES.items():
        assert alias.help and ("type" in alias.cli or "action" in alias.cli), name


# -- stats: one switch -------------------------------------------------------------------------

def _stats_engine(**kwargs) -> EngineCore:
    return EngineCore(EngineArgs(model="synthetic", block_size=4, **kwargs).create_engine_config(),
                      SyntheticExecutor)


@pytest.mark.parametrize("switch", [{"log_stats": True}, {"disable_log_stats": False}])
def test_one_switch_collects_stats_and_logs_the_line(switch, caplog, hot_path):
    """Before: log_stats=True gave no stats at all (the scheduler needed
    log_iteration_details too) and nothing logged them."""
    eng = _stats_engine(**switch)
    for i in range(3):
        eng.add_request(make_request(f"r{i}", [i + 1, 2, 3, 4, 5, 6], max_tokens=4,
                                     ignore_eos=True))
    with caplog.at_level(logging.INFO, logger=STATS_LOGGER):
        outs, _ = eng.step()
        stats = outs[0].scheduler_stats
        assert stats is not None and stats.num_running_reqs == 3
        # 18 prompt tokens computed, 3 sampled; without iteration details the last
        # prompt token of each request counts as generation (stat_logger.py).
        assert eng.stat_logger.prompt_tokens == 15 and eng.stat_logger.generation_tokens == 3
        assert not caplog.records  # busy, and the interval (10 s) has not passed
        run_to_completion(eng)
    lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
    assert len(lines) == 1  # the engine ran out of requests: the window's line
    assert lines[0].startswith("Engine 000: Avg prompt throughput: ")
    for part in ("Avg generation throughput:", "Running: 0 reqs", "Waiting: 0 reqs",
                 "KV cache usage:", "Prefix cache hit rate:"):
        assert part in lines[0]
    eng.shutdown()


def test_prompt_tokens_exact_with_iteration_details():
    eng = _stats_engine(log_stats=True, log_iteration_details=True)
    for i in range(3):
        eng.add_request(make_request(f"r{i}", [i + 1, 2, 3, 4, 5, 6], max_tokens=4))
    eng.step()
    assert eng.stat_logger.prompt_tokens == 18 and eng.stat_logger.generation_tokens == 3
    eng.shutdown()


def test_stats_off_by_default_cost_nothing():
    eng = _stats_engine()
    eng.add_request(make_request("r", [1, 2, 3], max_tokens=2))
    outs, _ = eng.step()
    assert eng.stat_logger is None and outs[0].scheduler_stats is None
    eng.shutdown()


def test_stats_line_every_interval_and_iteration_details(caplog, monkeypatch):
    import enginecore.core.stat_logger as stat_logger

    clock = [100.0]
    monkeypatch.setattr(stat_logger.time, "monotonic", lambda: clock[0])
    eng = _stats_engine(log_stats=True, log_stats_interval_s=5.0, log_iteration_details=True,
                        num_speculative_tokens=2)
    eng.add_request(make_request("r", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=40, ignore_eos=True))
    with caplog.at_level(logging.INFO, logger=STATS_LOGGER):
        for _ in range(3):
            clock[0] += 1.0
            eng.step_fn()
            eng.post_step(True)
        assert not [r for r in caplog.records if "throughput" in r.getMessage()]
        assert len([r for r in caplog.records if "prefill requests" in r.getMessage()]) == 3
        clock[0] += 5.0
        eng.step_fn()
    line = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()][-1]
    assert "Running: 1 reqs" in line
    eng.shutdown()


def test_multiprocess_engine_sends_stats_and_logs_the_line(capfd, hot_path):
    """Through the process boundary: the front-end gets SchedulerStats with no
    log_stats argument anywhere but EngineArgs, and the engine process logs."""
    config = EngineArgs(model="synthetic", block_size=4, log_stats=True).create_engine_config()
    client = make_client(True, False, config)
    try:
        client.add_request(EngineCoreRequest("r", [1, 2, 3, 4, 5],
                                             SamplingParams(max_tokens=3, ignore_eos=True)))
        seen_stats, finished = False, False
        while not finished:
            outs = client.get_output(timeout=30)
            seen_stats |= outs.scheduler_stats is not None
            finished = any(o.finish_reason is not None for o in outs.outputs)
    finally:
        client.shutdown()
    assert seen_stats
    assert "Engine 000: Avg prompt throughput" in capfd.readouterr().err
