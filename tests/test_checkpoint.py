"""save_sharded_state: a checkpoint both enginecore and transformers load, written
only inside the directory given."""

from __future__ import annotations

import json
import os

import pytest
import torch

from enginecore import EngineArgs, EngineCore
from helpers import run_to_completion
from test_model_families import FEW_BLOCKS
from test_model_llama import PROMPTS
from tiny_models import hf_greedy, make_tiny_model


def engine(model_dir: str, dtype: str = "float32") -> EngineCore:
    return EngineCore(EngineArgs(model=model_dir, dtype=dtype, block_size=4,
                                 max_model_len=64, **FEW_BLOCKS).create_engine_config())


def engine_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    from enginecore import EngineCoreRequest, SamplingParams

    eng = engine(model_dir)
    eng.add_request(EngineCoreRequest("g", prompt, SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True)))
    return run_to_completion(eng)["g"]["tokens"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, str] = {}

    def get(kind: str, **kw) -> str:
        key = kind + repr(sorted(kw.items()))
        if key not in made:
            made[key] = make_tiny_model(str(tmp_path_factory.mktemp(kind)), kind, seed=5, **kw)
        return made[key]

    return get


@pytest.mark.parametrize("kind,kw", [("llama", {"tie_word_embeddings": True}), ("phi3", {}),
                                     ("gemma2", {}), ("qwen3_moe", {})])
def test_sharded_checkpoint_loads_in_transformers_and_enginecore(models, kind, kw, tmp_path):
    src = models(kind, **kw)
    out = str(tmp_path / "saved")
    engine(src).save_sharded_state(out, max_size=40_000)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p for p in os.listdir(out) if p.endswith(".safetensors")) == shards
    from safetensors import safe_open

    names = set()
    for s in shards:
        with safe_open(os.path.join(out, s), "pt") as f:
            names |= set(f.keys())
    assert names == set(index["weight_map"])
    assert not any("qkv" in n or "gate_up" in n for n in names) or kind == "phi3"
    prompt = PROMPTS["d"][:12]
    # transformers reads it (index, names, config) and computes what the source computes.
    assert hf_greedy(out, prompt, 8) == hf_greedy(src, prompt, 8)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is kw.get("tie_word_embeddings", False)
    assert engine_greedy(out, prompt, 8) == hf_greedy(src, prompt, 8)  # enginecore reads it


def test_one_shard_is_model_safetensors_and_bf16_config(models, tmp_path):
    src = models("llama")
    out = tmp_path / "one"
    engine(src, "bfloat16").save_sharded_state(str(out))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def llama_engine(models):
    return engine(models("llama"))


def test_vllm_pattern_and_resave_into_same_directory(llama_engine, tmp_path):
    eng = llama_engine
    out = str(tmp_path / "p")
    pattern = "model-rank-{rank}-part-{part}.safetensors"
    eng.save_sharded_state(out, pattern=pattern, max_size=60_000)
    first = sorted(p for p in os.listdir(out) if p.endswith(".safetensors"))
    assert first[0] == "model-rank-0-part-0.safetensors" and len(first) > 1
    eng.save_sharded_state(out, pattern=pattern, max_size=60_000)  # same names: overwritten
    assert sorted(p for p in os.listdir(out) if p.endswith(".safetensors")) == first
    assert not [p for p in os.listdir(out) if p.endswith(".partial")]


@pytest.mark.parametrize("pattern", ["../escape-{}.safetensors", "/tmp/abs-{}.safetensors",
                                     "sub/dir-{}.safetensors", "model-{}.bin",
                                     "same.safetensors", "model-{missing}.safetensors"])
def test_pattern_outside_the_directory_is_refused_before_writing(llama_engine, tmp_path,
                                                                 pattern):
    eng = llama_engine
    out = tmp_path / "confined"
    with pytest.raises(ValueError, match="shard|pattern"):
        eng.save_sharded_state(str(out), pattern=pattern, max_size=60_000)
    assert not out.exists()
    assert not list(tmp_path.glob("escape-*")) and not os.path.exists("/tmp/abs-0.safetensors")


def test_directory_with_other_weights_or_links_is_refused(llama_engine, tmp_path):
    eng = llama_engine
    out = tmp_path / "busy"
    out.mkdir()
    (out / "old-weights.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="already holds other weights"):
        eng.save_sharded_state(str(out))
    (out / "old-weights.safetensors").unlink()
    (out / "config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ValueError, match="symbolic links"):
        eng.save_sharded_state(str(out))
    assert not (tmp_path / "elsewhere.json").exists()
    assert sorted(os.listdir(out)) == ["config.json"]
