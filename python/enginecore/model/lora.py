"""LoRA adapters in PEFT format (adapter_config.json + adapter_model.safetensors)
for the Llama-family model: loading with validation, and the per-token-group
delta applied after each targeted projection."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from enginecore.model.arch_config import LlamaArchConfig

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAError(ValueError):
    """An adapter that cannot be used: missing, wrong rank, target or shape."""


@dataclass
class LoRAWeights:
    lora_id: int
    name: str
    rank: int
    scaling: float
    # layers[i][target] = (A [r, in], B [out, r])
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


def _shapes(cfg: LlamaArchConfig) -> dict[str, tuple[int, int]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_adapter_config(path: str, lora_id: int, name: str, max_rank: int,
                        cfg: LlamaArchConfig | None = None) -> tuple[int, float]:
    """Check a PEFT adapter's files and config (against the model's ``cfg`` when
    given); (rank, scaling). Raises LoRAError. The front-end runs this too, so a
    bad adapter fails at the caller."""
    cfg_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not (os.path.isfile(cfg_path) and os.path.isfile(weights_path)):
        raise LoRAError(f"LoRA {name!r} ({lora_id}): {path} has no adapter_config.json and "
                        "adapter_model.safetensors (PEFT format)")
    with open(cfg_path) as f:
        ac = json.load(f)
    r = int(ac.get("r", 0))
    if not 0 < r <= max_rank:
        raise LoRAError(f"LoRA {name!r}: rank {r} is outside [1, max_lora_rank={max_rank}]")
    targets = ac.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    bad = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if bad:
        raise LoRAError(f"LoRA {name!r}: unsupported target modules {bad}; supported: "
                        f"{list(SUPPORTED_TARGETS)}")
    mlp = sorted(set(targets) & {"gate_proj", "up_proj", "down_proj"})
    if cfg is not None and cfg.moe is not None and mlp:
        raise LoRAError(f"LoRA {name!r}: {mlp} on a mixture-of-experts model is not supported "
                        "(adapters may target the attention projections only)")
    if cfg is not None and cfg.fused_checkpoint:
        raise LoRAError(f"LoRA {name!r}: adapters for {cfg.architecture} (fused projections) "
                        "are not supported")
    if ac.get("bias", "none") != "none":
        raise LoRAError(f"LoRA {name!r}: bias={ac['bias']!r} is not supported (only 'none')")
    alpha = float(ac.get("lora_alpha", r))
    return r, alpha / math.sqrt(r) if ac.get("use_rslora") else alpha / r


def load_lora(path: str, lora_id: int, name: str, cfg: LlamaArchConfig, max_rank: int,
              dtype: torch.dtype, device: torch.device) -> LoRAWeights:
    r, scaling = read_adapter_config(path, lora_id, name, max_rank, cfg)
    weights_path = os.path.join(path, "adapter_model.safetensors")
    shapes = _shapes(cfg)
    lw = LoRAWeights(lora_id, name, r, scaling, [{} for _ in range(cfg.num_layers)])
    with safe_open(weights_path, framework="pt") as f:
        for key in f.keys():
            # base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
            parts = key.split(".")
            try:
                li = int(parts[parts.index("layers") + 1])
                target = parts[-3]
                which = parts[-2]
            except (ValueError, IndexError):
                raise LoRAError(f"LoRA {name!r}: unexpected tensor {key!r}") from None
            if target not in SUPPORTED_TARGETS or which not in ("lora_A", "lora_B"):
                raise LoRAError(f"LoRA {name!r}: unsupported tensor {key!r}")
            if li >= cfg.num_layers:
                raise LoRAError(f"LoRA {name!r}: layer {li} >= the model's {cfg.num_layers}")
            t = f.get_tensor(key)
            fan_in, fan_out = shapes[target]
            want = (r, fan_in) if which == "lora_A" else (fan_out, r)
            if tuple(t.shape) != want:
                raise LoRAError(f"LoRA {name!r}: {key} has shape {tuple(t.shape)}, the model "
                                f"needs {want}")
            a, b = lw.layers[li].get(target, (None, None))
            t = t.to(device=device, dtype=dtype)
            lw.layers[li][target] = (t, b) if which == "lora_A" else (a, t)
    for li, layer in enumerate(lw.layers):
        for target, (a, b) in layer.items():
            if a is None or b is None:
                raise LoRAError(f"LoRA {name!r}: layer {li} {target} lacks lora_A or lora_B")
    return lw


@dataclass
class LoRABatch:
    """Which flat-batch tokens use which adapter (tokens without one are absent)."""

    groups: list[tuple[torch.Tensor, LoRAWeights]]

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int,
              targets: tuple[tuple[str, int, int], ...]) -> None:
        """out[:, start:end] += scale * x @ A^T @ B^T for each (target, start, end)."""
        T = x.shape[0]
        for idx, lw in self.groups:
            mods = lw.layers[layer]
            whole = idx.numel() == T  # every token on this adapter: no gather/scatter
            xs = x if whole else None
            for target, start, end in targets:
                ab = mods.get(target)
                if ab is None:
                    continue
                if xs is None:
                    xs = x.index_select(0, idx)
                delta = (xs @ ab[0].T) @ ab[1].T
                if whole:
                    out[:, start:end].add_(delta, alpha=lw.scaling)
                else:
                    out[idx, start:end] += delta * lw.scaling
