"""Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Qwen2, Mistral) over a
flattened batch and a paged KV cache.

Weights are held fused per layer (q|k|v and gate|up) so a step issues few
large matmuls, each a ``Linear`` pre-packed at load for the CPU GEMM
(model/linear.py); ``state_dict_hf`` gives them back plain under HF names.
Element-wise work goes through fused ops with native twins (fused_ops.py,
rope.py ``RotaryStep``) and attention through ``paged_attention``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from enginecore.model.arch_config import LlamaArchConfig
from enginecore.model.attention import AttentionMetadata, paged_attention
from enginecore.model.fused_ops import add_rms_norm, rms_norm, silu_and_mul
from enginecore.model.linear import Linear, packing_enabled
from enginecore.model.lora import LoRABatch
from enginecore.model.rope import RotaryStep, rope_cos_sin


class LlamaLayer:
    __slots__ = ("input_norm", "qkv_proj", "o_proj", "post_norm", "gate_up_proj", "down_proj")


class LlamaForCausalLM:
    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.layers: list[LlamaLayer] = []
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        # The LM head: plain only when tied (it is the embedding), else just packed.
        self.lm_head: torch.Tensor | None = None
        self.lm_head_proj: Linear | None = None
        self.tied = cfg.tie_word_embeddings
        self.pack = packing_enabled(dtype, device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.max_positions = max(cfg.max_position_embeddings, 1)
        q, kv, inter, hid = self.q_size, self.kv_size, cfg.intermediate_size, cfg.hidden_size
        # Where each LoRA target's output sits in the fused projections.
        self._lora_targets = (
            (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)),
            (("o_proj", 0, hid),),
            (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)),
            (("down_proj", 0, hid),),
        )
        cos, sin = rope_cos_sin(cfg, self.max_positions)
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)

    # -- weights ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...)."""
        cfg = self.cfg
        n = cfg.num_layers
        parts: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        for name, tensor in weights:
            t = tensor.to(device=self.device, dtype=self.dtype)
            if name == "model.embed_tokens.weight":
                self.embed = t
            elif name == "model.norm.weight":
                self.norm = t
            elif name == "lm_head.weight":
                self.lm_head = t
            elif name.startswith("model.layers."):
                idx_s, rest = name[len("model.layers."):].split(".", 1)
                idx = int(idx_s)
                if idx >= n:
                    raise ValueError(f"weight {name} is beyond num_hidden_layers={n}")
                parts[idx][rest] = t
            elif name.endswith("rotary_emb.inv_freq"):
                continue
            else:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
        if self.embed is None or self.norm is None:
            raise ValueError("checkpoint lacks model.embed_tokens.weight or model.norm.weight")
        if self.lm_head is None:
            if not cfg.tie_word_embeddings:
                raise ValueError("checkpoint lacks lm_head.weight and tie_word_embeddings is false")
            self.lm_head = self.embed
        self.tied = self.lm_head is self.embed
        self.lm_head_proj = Linear(self.lm_head, pack=self.pack)
        if not self.tied:
            self.lm_head = None
        self.layers = [self._build_layer(i, p) for i, p in enumerate(parts)]

    def _build_layer(self, i: int, p: dict[str, torch.Tensor]) -> LlamaLayer:
        def take(key: str) -> torch.Tensor:
            try:
                return p.pop(key)
            except KeyError:
                raise ValueError(f"checkpoint lacks model.layers.{i}.{key}") from None

        layer = LlamaLayer()
        layer.input_norm = take("input_layernorm.weight")
        layer.post_norm = take("post_attention_layernorm.weight")
        qkv_w = torch.cat([take("self_attn.q_proj.weight"), take("self_attn.k_proj.weight"),
                           take("self_attn.v_proj.weight")]).contiguous()
        qkv_b = None
        if self.cfg.qkv_bias:
            qkv_b = torch.cat([take("self_attn.q_proj.bias"), take("self_attn.k_proj.bias"),
                               take("self_attn.v_proj.bias")]).contiguous()
        layer.qkv_proj = Linear(qkv_w, qkv_b, self.pack)
        layer.o_proj = Linear(take("self_attn.o_proj.weight"), pack=self.pack)
        gate_up_w = torch.cat([take("mlp.gate_proj.weight"),
                               take("mlp.up_proj.weight")]).contiguous()
        layer.gate_up_proj = Linear(gate_up_w, pack=self.pack)
        layer.down_proj = Linear(take("mlp.down_proj.weight"), pack=self.pack)
        if p:
            raise ValueError(f"unexpected weights in layer {i}: {sorted(p)}")
        return layer

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """The weights under HF names (unfused), for saving."""
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed,
                                        "model.norm.weight": self.norm}
        if not self.tied:
            out["lm_head.weight"] = self.lm_head_proj.dense()
        q, kv, inter = self.q_size, self.kv_size, self.cfg.intermediate_size
        for i, L in enumerate(self.layers):
            pre = f"model.layers.{i}."
            wq, wk, wv = L.qkv_proj.dense().split([q, kv, kv])
            out |= {pre + "self_attn.q_proj.weight": wq, pre + "self_attn.k_proj.weight": wk,
                    pre + "self_attn.v_proj.weight": wv,
                    pre + "self_attn.o_proj.weight": L.o_proj.dense(),
                    pre + "input_layernorm.weight": L.input_norm,
                    pre + "post_attention_layernorm.weight": L.post_norm,
                    pre + "mlp.down_proj.weight": L.down_proj.dense()}
            if L.qkv_proj.bias is not None:
                bq, bk, bv = L.qkv_proj.bias.split([q, kv, kv])
                out |= {pre + "self_attn.q_proj.bias": bq, pre + "self_attn.k_proj.bias": bk,
                        pre + "self_attn.v_proj.bias": bv}
            g, u = L.gate_up_proj.dense().split([inter, inter])
            out |= {pre + "mlp.gate_proj.weight": g, pre + "mlp.up_proj.weight": u}
        return {k: v.contiguous() for k, v in out.items()}

    def to_device(self, device: torch.device) -> None:
        """Move every weight (sleep level 1 on CUDA parks them in host memory)."""
        self.embed = self.embed.to(device)
        self.norm = self.norm.to(device)
        self.lm_head_proj = self.lm_head_proj.to(device)
        self.lm_head = self.embed if self.tied else None
        for layer in self.layers:
            for name in LlamaLayer.__slots__:  # tensors and Linears alike
                setattr(layer, name, getattr(layer, name).to(device))
        self.cos = self.cos.to(device)
        self.sin = self.sin.to(device)
        self.device = device

    def weight_bytes(self) -> int:
        """Bytes of the weights as loaded (the packed LM head of a tied model is extra)."""
        total = sum(t.numel() * t.element_size() for t in (self.embed, self.norm))
        if not self.tied:
            total += self.lm_head_proj.nbytes()
        for L in self.layers:
            total += sum(t.numel() * t.element_size() for t in (L.input_norm, L.post_norm))
            total += sum(p.nbytes() for p in (L.qkv_proj, L.o_proj, L.gate_up_proj, L.down_proj))
        return total

    # -- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        T = input_ids.shape[0]
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.q_size, self.kv_size
        eps = cfg.rms_norm_eps
        rope = RotaryStep(self.cos, self.sin, positions)
        h = F.embedding(input_ids, self.embed)
        delta: torch.Tensor | None = None  # the last block's output, not yet added to h
        qkv_t, o_t, gu_t, down_t = self._lora_targets
        for li, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if delta is None:
                x = rms_norm(h, layer.input_norm, eps)
            else:
                h, x = add_rms_norm(h, delta, layer.input_norm, eps)
            qkv = layer.qkv_proj(x)
            if lora is not None:
                lora.apply(qkv, x, li, qkv_t)
            # q and k sit side by side in qkv: rotate both with one call.
            qk = rope(qkv[:, : q_size + kv_size].view(T, H + Hkv, D))
            v = qkv[:, q_size + kv_size :].view(T, Hkv, D)
            attn = paged_attention(qk[:, :H], qk[:, H:], v, k_cache, v_cache, meta, self.scale)
            o = layer.o_proj(attn)
            if lora is not None:
                lora.apply(o, attn, li, o_t)
            h, x = add_rms_norm(h, o, layer.post_norm, eps)
            gu = layer.gate_up_proj(x)
            if lora is not None:
                lora.apply(gu, x, li, gu_t)
            act = silu_and_mul(gu)
            delta = layer.down_proj(act)
            if lora is not None:
                lora.apply(delta, act, li, down_t)
        if delta is None:
            return rms_norm(h, self.norm, eps)
        return add_rms_norm(h, delta, self.norm, eps)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head_proj(hidden).float()
