"""Resolve ``EngineArgs.model`` to files on disk and read the facts the engine needs."""

from __future__ import annotations

import json
import logging
import os

import torch

from enginecore.model.arch_config import load_arch_config
from enginecore.model.bert import is_encoder_config, load_bert_config
from enginecore.model.cpu_flags import cpu_flags
from enginecore.model.linear import cpu_packs_bf16
from enginecore.model_config import ModelConfig

logger = logging.getLogger(__name__)


def resolve_model_path(model: str | None, progress: bool = True) -> tuple[str, str]:
    """(display name, HF directory). None = the default model. Never reaches a hub.

    Order: None -> the default GGUF; an existing ``.gguf`` file -> converted once;
    an existing directory -> used as it is; otherwise a hub-style name
    (``org/name``) -> its snapshot in the local Hugging Face cache."""
    from enginecore.model.default_model import DEFAULT_MODEL_NAME, default_gguf_path
    from enginecore.model.gguf_loader import ensure_converted
    from enginecore.model.hf_cache import find_cached_snapshot, hf_hub_cache_dir, looks_like_repo_id

    if model is None:
        return DEFAULT_MODEL_NAME, ensure_converted(default_gguf_path(progress=progress),
                                                    progress=progress)
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return model, ensure_converted(path, progress=progress)
    if os.path.isdir(path):
        return model, check_model_dir(path)
    if os.path.exists(path):
        raise ValueError(f"model {model!r} is a file but not a .gguf; pass an HF-format "
                         "directory (config.json, *.safetensors, tokenizer.json) or a .gguf file")
    if looks_like_repo_id(model):
        snapshot = find_cached_snapshot(model)
        if snapshot is not None:
            logger.info("model %s found in the Hugging Face cache: %s", model, snapshot)
            return model, check_model_dir(snapshot)
        raise FileNotFoundError(
            f"model {model!r} is not a local path and not in the Hugging Face cache at "
            f"{hf_hub_cache_dir()} (set HF_HUB_CACHE or HF_HOME to look elsewhere); enginecore "
            "never downloads from a model hub: fetch it where there is a network "
            f"(`hf download {model}`) or pass a local directory or .gguf file"
        )
    raise FileNotFoundError(
        f"model {model!r} not found: pass an HF-format directory (config.json, *.safetensors, "
        "tokenizer.json), a .gguf file or a name in the local Hugging Face cache; enginecore "
        "never downloads from a model hub"
    )


def check_model_dir(path: str) -> str:
    """An HF model directory must hold config.json: say so instead of a bare errno."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path} is not an HF model directory: it has no config.json (expected "
            "config.json, *.safetensors weights and tokenizer.json)"
        )
    return path


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unsupported device {device!r}; supported: auto, cpu, cuda[:N]")
    return device


def cpu_runs_bf16_fast() -> bool:
    """Whether bfloat16 is the faster model dtype on this CPU: a native bf16 GEMM
    (AVX512_BF16 / AMX, oneDNN's), or AVX2 + FMA without the AVX-512 oneDNN packs
    bf16 for, where ``_C.bf16_linear`` runs bf16 weights above torch's float32 speed
    at every batch and a memory-bound decode moves half the bytes
    (docs/benchmarks.md). AVX-512 without BF16 (oneDNN emulates it; not measured)
    and older CPUs: float32. By CPU flags only, so both paths pick the same dtype."""
    flags = cpu_flags()
    if {"avx512_bf16", "amx_bf16"} & flags:
        return True
    return {"avx2", "fma"} <= flags and not cpu_packs_bf16()


_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32",
           "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        if device.startswith("cuda"):
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return "bfloat16" if cpu_runs_bf16_fast() else "float32"
    if dtype not in _DTYPES:
        raise ValueError(
            f"unsupported dtype {dtype!r}; supported: auto, float32, bfloat16, float16")
    resolved = _DTYPES[dtype]
    if resolved == "float16" and device == "cpu":
        raise ValueError("float16 is not supported on CPU; use bfloat16 or float32")
    return resolved


def resolve_model_config(
    model: str | None, *, dtype: str, device: str, seed: int, max_model_len: int | None
) -> ModelConfig:
    name, path = resolve_model_path(model)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if is_encoder_config(raw):
        return _encoder_model_config(name, path, dtype, device, seed, max_model_len)
    arch = load_arch_config(path)
    limit = arch.max_position_embeddings
    explicit_len = max_model_len is not None
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's context ({limit} positions)"
        )
    short = arch.longrope_limit
    if short is not None and max_model_len > short:
        if explicit_len:
            raise ValueError(
                f"max_model_len {max_model_len} needs LongRoPE's long factors (beyond "
                f"original_max_position_embeddings={short}), which are not supported; "
                f"use max_model_len <= {short}")
        logger.warning("LongRoPE: only the short factors are supported; max_model_len capped "
                       "at original_max_position_embeddings=%d", short)
        max_model_len = short
    eos = _tokenizer_eos(path)
    if eos is None:
        eos = arch.eos_token_id
    return ModelConfig(
        model=name,
        dtype=dtype,
        device=device,
        seed=seed,
        max_model_len=max_model_len,
        vocab_size=arch.vocab_size,
        eos_token_id=eos,
        bos_token_id=arch.bos_token_id,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        architecture=arch.architecture,
        model_path=path,
        is_moe=arch.moe is not None or config_names_experts(raw),
    )


def config_names_experts(cfg: dict) -> bool:
    """Whether config.json names experts (MoE: data-parallel lockstep by default)."""
    return any(int(cfg.get(k) or 0) > 1 for k in ("num_experts", "num_local_experts",
                                                  "n_routed_experts"))


def _encoder_model_config(name, path, dtype, device, seed, max_model_len) -> ModelConfig:
    cfg = load_bert_config(path)
    limit = cfg.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
    return ModelConfig(
        model=name, dtype=dtype, device=device, seed=seed,
        max_model_len=max_model_len or limit, vocab_size=cfg.vocab_size, eos_token_id=None,
        num_layers=0, num_kv_heads=0, head_dim=0, architecture="BertModel", model_path=path,
        task="embed",
    )


def _tokenizer_eos(path: str) -> int | None:
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        return None
    from enginecore.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(path).eos_token_id
