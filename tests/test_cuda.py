"""On a CUDA device: the model runner against transformers, sleep level 1 (weights to
host memory and back), data-parallel device placement. Skipped without CUDA;
`make gpu-check` runs them (and ENGINECORE_CUDA_TESTS_ON_CPU=1 runs them on the
CPU, where the checks that only mean something on CUDA skip themselves)."""

from __future__ import annotations

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.client import make_client
from enginecore.client.sockets import rank_devices
from helpers import run_to_completion
from test_model_llama import PROMPTS, engine_tokens
from tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = make_tiny_model(str(tmp_path_factory.mktemp(kind)), kind, seed=7)
        return made[kind]

    return get


def args(model_dir: str, device: str, **kw) -> dict:
    a = dict(model=model_dir, device=device, dtype="float32", block_size=4, max_model_len=64,
             num_gpu_blocks_override=512)
    a.update(kw)
    return a


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "qwen3_moe"])
def test_runner_float32_is_token_exact(tiny, cuda_device, kind):
    """float32 on the device gives transformers' (CPU, float32) greedy tokens."""
    model_dir = tiny(kind)
    kw = args(model_dir, cuda_device)
    kw.pop("model")
    eng, got = engine_tokens(model_dir, **kw)
    assert eng.model_executor.runner.device.type == cuda_device
    assert got == {rid: hf_greedy(model_dir, p, 12) for rid, p in PROMPTS.items()}


def test_runner_bfloat16_agrees_with_transformers_bfloat16(tiny, cuda_device):
    """bfloat16: first tokens agree with transformers in bfloat16 on the same device
    (the two differ in kernels and summation order, so agreement, not identity)."""
    import transformers

    model_dir = tiny("llama")
    kw = args(model_dir, cuda_device, dtype="bfloat16")
    kw.pop("model")
    _, got = engine_tokens(model_dir, **kw)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16).to(cuda_device).eval()
    agree = 0
    with torch.no_grad():
        for rid, p in PROMPTS.items():
            logits = ref_model(torch.tensor([p], device=cuda_device)).logits[0, -1]
            agree += int(logits.argmax()) == got[rid][0]
    assert agree >= 4, (agree, got)


def test_sleep_level1_offloads_weights_and_wakes(tiny, cuda_device):
    model_dir = tiny("llama")
    # The KV cache sized by profiling (a small share of the device, not the default 0.9).
    kw = args(model_dir, cuda_device, gpu_memory_utilization=0.02, block_size=16)
    del kw["num_gpu_blocks_override"]
    if cuda_device == "cpu":
        kw["kv_cache_memory_bytes"] = 8 << 20
    eng = EngineCore(EngineArgs(**kw).create_engine_config())
    runner = eng.model_executor.runner
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng.add_request(EngineCoreRequest("a", PROMPTS["d"], sp))
    before = run_to_completion(eng)["a"]["tokens"]
    on_cuda = cuda_device == "cuda"
    allocated = torch.cuda.memory_allocated() if on_cuda else 0
    eng.sleep(level=1)
    assert eng.is_sleeping() and not runner.kv_caches
    if on_cuda:
        assert runner.model.embed.device.type == "cpu"  # parked in host memory
        assert all(t.device.type == "cpu" for t in runner.model.state_dict_hf().values())
        freed = allocated - torch.cuda.memory_allocated()
        assert freed >= runner.model.weight_bytes(), (freed, runner.model.weight_bytes())
    eng.wake_up()
    assert not eng.is_sleeping()
    assert runner.model.embed.device.type == cuda_device
    eng.add_request(EngineCoreRequest("b", PROMPTS["d"], sp))
    assert run_to_completion(eng)["b"]["tokens"] == before


def test_dp_ranks_get_their_own_device(tiny, cuda_device, monkeypatch):
    """Each DP rank sees one device through CUDA_VISIBLE_DEVICES, set before torch
    loads in its process. One GPU: both ranks share device 0 ("0,0")."""
    model_dir = tiny("llama")
    count = torch.cuda.device_count() if cuda_device == "cuda" else 0
    if count == 1:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    elif count > 1:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = EngineArgs(**args(model_dir, cuda_device, data_parallel_size=2)).create_engine_config()
    c = make_client(True, False, cfg)
    try:
        infos = [c.call_utility_on(e, "collective_rpc", "device_info", timeout=60)[0]
                 for e in range(2)]
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for i in range(4):
            c.add_request(EngineCoreRequest(f"r{i}", PROMPTS["c"], sp))
        done, got = 0, {}
        while done < 4:
            for o in c.get_output(timeout=60).outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                done += o.finish_reason is not None
    finally:
        c.shutdown()
    assert len(set(map(tuple, got.values()))) == 1  # the same tokens on every rank
    assert all(info["device"].startswith(cuda_device) for info in infos)
    if count:
        assert [i["cuda_visible_devices"] for i in infos] == (["0", "0"] if count == 1
                                                              else ["0", "1"])
        assert all(i["cuda_device_count"] == 1 for i in infos)
        if count > 1:
            assert infos[0]["cuda_device_uuid"] != infos[1]["cuda_device_uuid"]


def test_dp_ranks_beyond_the_devices_are_refused(tiny, cuda_device, monkeypatch):
    if cuda_device != "cuda":
        pytest.skip("device counting needs CUDA")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    n = torch.cuda.device_count()
    cfg = EngineArgs(**args(tiny("llama"), "cuda", data_parallel_size=n + 1)
                     ).create_engine_config()
    with pytest.raises(ValueError, match=f"needs {n + 1} devices, but only {n}"):
        rank_devices(cfg)


def test_seeded_random_sampling_on_the_device(tiny, cuda_device):
    """Temperature, top-k, top-p and min-p draws on the device (the sampler's torch path:
    the race's uniforms and top-p's sort made where the logits are): a seed gives the
    same tokens twice, and every token is in the vocabulary."""
    model_dir = tiny("llama")
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=6, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, top_k=5, min_p=0.05, seed=7,
                             ignore_eos=True)]
    runs = []
    for _ in range(2):
        eng = EngineCore(EngineArgs(**args(model_dir, cuda_device)).create_engine_config())
        for i, sp in enumerate(params):
            eng.add_request(EngineCoreRequest(f"s{i}", [3 + i, 9, 27], sp))
        done = run_to_completion(eng)
        eng.shutdown()
        runs.append({rid: done[rid]["tokens"] for rid in sorted(done)})
    vocab = eng.model_executor.runner.model.cfg.vocab_size
    assert runs[0] == runs[1]
    assert all(len(t) == 6 and all(0 <= x < vocab for x in t) for t in runs[0].values())
