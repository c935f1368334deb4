"""The architecture facts of a decoder, read from an HF config.json.

One decoder (model/llama.py) runs every supported family; what differs between
them is expressed here as data, following each family's transformers
implementation (its config defaults included), so the decoder only branches
on fields:

- Mistral: sliding window on every layer (``sliding_window``).
- Qwen2: q/k/v bias; sliding window on layers >= ``max_window_layers`` when
  ``use_sliding_window``.
- Qwen3: RMSNorm of each q and k head before RoPE; windows as Qwen2.
- Gemma 2: embeddings times sqrt(hidden); RMSNorm scales by (1 + w) in float32;
  norms after attention and around the MLP; attention scale
  ``query_pre_attn_scalar``; tanh soft-capping of attention scores and of the
  final logits; sliding window on alternate layers; gelu (tanh).
- Phi-3: fused ``qkv_proj`` / ``gate_up_proj`` tensors; partial rotary; LongRoPE
  (``longrope``/``su``).
- Mixtral: Mistral attention; sparse MoE MLP (softmax, top-k, renormalised,
  float32 weights).
- Qwen3-MoE: Qwen3 attention; sparse MoE MLP (``norm_topk_prob``, weights in the
  model dtype), dense layers per ``mlp_only_layers`` / ``decoder_sparse_step``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from enginecore.model.mm_registry import unsupported_multimodal_error

# HF architecture name -> family (the keys of _FAMILY_DEFAULTS).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # Vision-language: the decoder is read from text_config (model/qwen2_vl.py adds the rest)
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# Config defaults that differ per family (transformers' config classes).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "gemma2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
               "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "sliding_window": 4096},
    "phi3": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen2_vl": {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
}


@dataclass
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # Renormalise the top-k probabilities to sum to one.
    normalize_top_k: bool
    # Qwen3-MoE casts the routing weights to the model dtype; Mixtral keeps float32.
    weights_in_model_dtype: bool
    # Which layers have the sparse block (the others a dense MLP).
    sparse_layers: list[bool]
    # Tensor names on disk: "mixtral" (block_sparse_moe.experts.N.w1/w2/w3) or
    # "qwen" (mlp.experts.N.gate_proj/up_proj/down_proj).
    naming: str


@dataclass
class LlamaArchConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    family: str = "llama"
    hidden_act: str = "silu"
    # Sliding-window size of each layer (None: full attention).
    layer_windows: list[int | None] = field(default_factory=list)
    # Dimensions of each head that RoPE rotates (Phi-3's partial_rotary_factor).
    rotary_dim: int = 0
    qk_norm: bool = False
    norm_plus_one: bool = False
    embed_scale: float | None = None
    # Gemma 2: RMSNorm on the attention output and on the MLP output.
    sandwich_norms: bool = False
    attn_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Phi-3 stores q|k|v and gate|up fused on disk.
    fused_checkpoint: bool = False
    moe: MoEConfig | None = None
    # Qwen2-VL's M-RoPE: frequencies per (temporal, height, width) section (sum: rotary_dim / 2)
    mrope_section: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_layers
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def longrope_limit(self) -> int | None:
        """LongRoPE: the context its short factors cover (beyond it transformers
        switches every position to the long factors, which is not built here)."""
        sc = self.rope_scaling
        return int(sc["original_max_position_embeddings"]) if sc and sc["rope_type"] == "longrope" \
            else None


def load_arch_config(model_dir: str) -> LlamaArchConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{model_dir} is not an HF model directory: it has no "
                                "config.json") from None
    return arch_config_from_hf(cfg, source=path)


def supported_architectures_text() -> str:
    return ", ".join([*SUPPORTED_ARCHITECTURES, "LlavaForConditionalGeneration"])


def arch_config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> LlamaArchConfig:
    archs = cfg.get("architectures") or []
    if "LlavaForConditionalGeneration" in archs:
        return _llava_arch_config(cfg, source)
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and "vision_config" in cfg:
        raise unsupported_multimodal_error(str(archs or cfg.get("model_type")))
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {source}; "
            f"supported: {supported_architectures_text()}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    defaults = _FAMILY_DEFAULTS[family]
    if family == "qwen2_vl" and "text_config" in cfg:  # transformers 5 nests the decoder
        cfg = {**cfg["text_config"], "architectures": archs,
               "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}

    def get(key: str, fallback: Any = None) -> Any:
        # A key written as null stays null (Gemma 2 turns soft-capping off that way).
        return cfg[key] if key in cfg else defaults.get(key, fallback)

    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or (
        "gelu_pytorch_tanh" if family == "gemma2" else "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r} in {source}; "
                         f"supported: {SUPPORTED_ACTIVATIONS}")
    if cfg.get("mlp_bias"):
        raise ValueError(f"mlp_bias=true in {source} is not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(cfg["num_hidden_layers"])
    rope, theta = _rope(cfg, defaults, source)
    mrope = rope.pop("mrope_section", None)
    partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    if rope["rope_type"] == "longrope":
        rope.setdefault("original_max_position_embeddings",
                        cfg.get("original_max_position_embeddings"))
        if rope["original_max_position_embeddings"] is None:
            raise ValueError(f"longrope in {source} needs original_max_position_embeddings")
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    a = LlamaArchConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=rope if rope["rope_type"] != "default" else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=family in ("qwen2", "qwen2_vl") or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        family=family,
        hidden_act=act,
        layer_windows=_layer_windows(cfg, family, layers, get("sliding_window")),
        rotary_dim=int(head_dim * partial),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        fused_checkpoint=family == "phi3",
        moe=_moe(cfg, family, layers, source),
        mrope_section=mrope,
    )
    if family == "gemma2":
        a.norm_plus_one = True
        a.sandwich_norms = True
        a.embed_scale = hidden**0.5
        a.attn_scale = float(get("query_pre_attn_scalar")) ** -0.5
        a.attn_logit_softcap = get("attn_logit_softcapping")
        a.final_logit_softcap = get("final_logit_softcapping")
    return a


# LLaVA's text_config.model_type -> the decoder architecture that runs it
_LLAVA_DECODERS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM"}


def _llava_arch_config(cfg: dict[str, Any], source: str) -> LlamaArchConfig:
    """LLaVA: the decoder of its text_config (a Llama-family LM); model/llava.py
    reads the vision tower and projector."""
    text = dict(cfg.get("text_config") or {"model_type": "llama"})
    decoder = _LLAVA_DECODERS.get(text.get("model_type", "llama"))
    if decoder is None:
        raise ValueError(f"LlavaForConditionalGeneration with a {text.get('model_type')!r} "
                         f"language model in {source}; supported: {sorted(_LLAVA_DECODERS)}")
    text["architectures"] = [decoder]
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    a = arch_config_from_hf(text, source)
    a.architecture = "LlavaForConditionalGeneration"
    return a


def _rope(cfg: dict[str, Any], defaults: dict[str, Any], source: str):
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or None
    if scaling:
        rope.update(scaling)
    theta = float(rope.pop("rope_theta", None) or cfg.get("rope_theta") or defaults["rope_theta"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "su":  # the earlier name of longrope
        rope_type = "longrope"
    if rope_type == "mrope":  # Qwen2-VL's earlier name: default frequencies, in sections
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} in {source}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    rope.pop("type", None)
    rope["rope_type"] = rope_type
    return rope, theta


def _layer_windows(cfg: dict[str, Any], family: str, layers: int,
                   window: int | None) -> list[int | None]:
    """Each layer's sliding window, as transformers assigns them."""
    if (family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_vl")
            and not cfg.get("use_sliding_window", False)):
        window = None
    if not window:
        return [None] * layers
    window = int(window)
    types = cfg.get("layer_types")
    if not types:
        if family == "gemma2":  # even layers slide, odd layers see everything
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                     for i in range(layers)]
        elif family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_vl"):
            first = int(cfg.get("max_window_layers") or 28)
            types = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(layers)]
        else:  # Mistral, Mixtral, Phi-3: the window applies to every layer
            types = ["sliding_attention"] * layers
    return [window if t == "sliding_attention" else None for t in types]


def _moe(cfg: dict[str, Any], family: str, layers: int, source: str) -> MoEConfig | None:
    if family not in ("mixtral", "qwen3_moe"):
        return None
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 2)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"bad MoE config in {source}: {experts} experts, top-{top_k}")
    if family == "mixtral":
        return MoEConfig(experts, top_k, int(cfg["intermediate_size"]), True, False,
                         [True] * layers, "mixtral")
    only_dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    sparse = [i not in only_dense and (i + 1) % step == 0 for i in range(layers)]
    return MoEConfig(experts, top_k, int(cfg.get("moe_intermediate_size") or
                                         cfg["intermediate_size"]),
                     bool(cfg.get("norm_topk_prob", False)), True, sparse, "qwen")
