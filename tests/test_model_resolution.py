"""EngineArgs.model -> files: the local Hugging Face cache (no network), clear
messages for directories without config.json and unsupported architectures."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from enginecore import EngineArgs
from enginecore.model.arch_config import SUPPORTED_ARCHITECTURES
from enginecore.model.hf_cache import hf_hub_cache_dir
from tiny_models import make_tiny_model

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "llama")


def fill_cache(hub: str, repo_id: str, src: str) -> str:
    """The cache layout huggingface_hub writes: refs/main -> snapshots/<sha>/files."""
    repo = os.path.join(hub, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", SHA)
    os.makedirs(os.path.join(repo, "refs"))
    shutil.copytree(src, snapshot)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(SHA)
    return snapshot


@pytest.fixture
def clean_hf_env(monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_name_in_hf_hub_cache_resolves(tiny, tmp_path, clean_hf_env):
    snapshot = fill_cache(str(tmp_path / "hub"), "tiny-org/tiny-llama", tiny)
    clean_hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    mc = EngineArgs(model="tiny-org/tiny-llama", dtype="float32").create_engine_config(
    ).model_config
    assert mc.model_path == snapshot and mc.model == "tiny-org/tiny-llama"
    assert mc.architecture == "LlamaForCausalLM"


def test_hf_home_is_honoured(tiny, tmp_path, clean_hf_env):
    snapshot = fill_cache(str(tmp_path / "home" / "hub"), "org/m", tiny)
    clean_hf_env.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache_dir() == str(tmp_path / "home" / "hub")
    mc = EngineArgs(model="org/m", dtype="float32").create_engine_config().model_config
    assert mc.model_path == snapshot


def test_name_not_cached_names_the_cache(tmp_path, clean_hf_env):
    clean_hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(FileNotFoundError) as e:
        EngineArgs(model="HuggingFaceTB/SmolLM2-135M-Instruct").create_engine_config()
    msg = str(e.value)
    assert str(tmp_path / "empty-hub") in msg and "never downloads" in msg
    assert "HF_HUB_CACHE" in msg


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json") as e:
        EngineArgs(model=str(tmp_path)).create_engine_config()
    assert "Errno" not in str(e.value)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel") as e:
        EngineArgs(model=str(tmp_path)).create_engine_config()
    assert all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)


def test_not_a_path_nor_a_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        EngineArgs(model=str(tmp_path / "missing" / "dir")).create_engine_config()
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        EngineArgs(model=str(tmp_path / "weights.bin")).create_engine_config()
