"""The decoder of every supported family (Llama 2/3, SmolLM/SmolLM2, Mistral,
Qwen2, Qwen3, Gemma 2, Phi-3, Mixtral, Qwen3-MoE) over a flattened batch and a
paged KV cache. What differs between families is data in LlamaArchConfig
(model/arch_config.py); here it is a handful of ``if`` hooks.

Weights are held fused per layer (q|k|v and gate|up) so a step issues few
large matmuls, each a ``Linear`` pre-packed at load for the CPU GEMM
(model/linear.py); ``state_dict_hf`` gives them back plain under the
checkpoint's names. Norms, the residual adds, RoPE and SiLU-and-mul go
through fused ops with native twins (model/fused_ops.py, rope.RotaryStep),
attention through ``paged_attention``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from enginecore.model.arch_config import LlamaArchConfig
from enginecore.model.attention import AttentionMetadata, paged_attention
from enginecore.model.fused_ops import add_rms_norm, rms_norm, silu_and_mul
from enginecore.model.linear import Linear, gemv_enabled, packing_enabled
from enginecore.model.lora import LoRABatch
from enginecore.model.moe import (
    PackedExperts,
    experts_state_dict,
    moe_mlp,
    pack_experts,
    take_experts,
)
from enginecore.model.rope import RotaryStep, rope_cos_sin


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class LlamaLayer:
    # qkv_w, o_w, gate_up_w, down_w hold ``Linear``s once loaded (bias inside qkv_w too)
    __slots__ = ("input_norm", "qkv_w", "qkv_b", "o_w", "post_norm", "gate_up_w", "down_w",
                 # Qwen3: [H + Hkv, D] q-norm rows then k-norm rows (one norm call for both)
                 "qk_norm_w",
                 # Gemma 2: norms of the attention output and of the MLP output
                 "attn_out_norm", "mlp_out_norm",
                 # MoE layers: router [E, hidden], experts [E, 2I, hidden] and [E, hidden, I]
                 "router_w", "experts_gate_up_w", "experts_down_w")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, None)


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
        self.gemv = False  # decided at load, by the projections' size (linear.py)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.scale
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.silu = cfg.hidden_act == "silu"  # SiLU-and-mul has a fused op
        # transformers multiplies by the scale cast to the weights' dtype.
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=dtype, device=device)
                            if cfg.embed_scale is not None else None)
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
        self.gemv = gemv_enabled(self.pack, sum(t.numel() * t.element_size()
                                                for part in parts for t in part.values()))
        self.lm_head_proj = Linear(self.lm_head, pack=self.pack, gemv=self.gemv)
        if not self.tied:
            self.lm_head = None
        self.layers = [self._as_linears(self._build_layer(i, p)) for i, p in enumerate(parts)]

    def _as_linears(self, layer: LlamaLayer) -> LlamaLayer:
        """The layer's projections as ``Linear``s (packed for the CPU GEMM once, here)."""
        layer.qkv_w = Linear(layer.qkv_w, layer.qkv_b, self.pack, self.gemv)
        layer.o_w = Linear(layer.o_w, pack=self.pack, gemv=self.gemv)
        if layer.gate_up_w is not None:
            layer.gate_up_w = Linear(layer.gate_up_w, pack=self.pack, gemv=self.gemv)
            layer.down_w = Linear(layer.down_w, pack=self.pack, gemv=self.gemv)
        if layer.experts_gate_up_w is not None:
            layer.experts_gate_up_w = pack_experts(layer.experts_gate_up_w, self.pack)
            layer.experts_down_w = pack_experts(layer.experts_down_w, self.pack)
        return layer

    def _build_layer(self, i: int, p: dict[str, torch.Tensor]) -> LlamaLayer:
        cfg = self.cfg

        def take(key: str) -> torch.Tensor:
            try:
                return p.pop(key)
            except KeyError:
                raise ValueError(f"checkpoint lacks model.layers.{i}.{key}") from None

        layer = LlamaLayer()
        layer.input_norm = take("input_layernorm.weight")
        if cfg.sandwich_norms:  # Gemma 2's names: post_attention is the attention output's
            layer.attn_out_norm = take("post_attention_layernorm.weight")
            layer.post_norm = take("pre_feedforward_layernorm.weight")
            layer.mlp_out_norm = take("post_feedforward_layernorm.weight")
        else:
            layer.post_norm = take("post_attention_layernorm.weight")
        if cfg.fused_checkpoint:
            layer.qkv_w = take("self_attn.qkv_proj.weight")
        else:
            layer.qkv_w = torch.cat([take("self_attn.q_proj.weight"),
                                     take("self_attn.k_proj.weight"),
                                     take("self_attn.v_proj.weight")]).contiguous()
        if cfg.qkv_bias:
            layer.qkv_b = torch.cat([take("self_attn.q_proj.bias"), take("self_attn.k_proj.bias"),
                                     take("self_attn.v_proj.bias")]).contiguous()
        layer.o_w = take("self_attn.o_proj.weight")
        if cfg.qk_norm:
            qn, kn = take("self_attn.q_norm.weight"), take("self_attn.k_norm.weight")
            layer.qk_norm_w = torch.cat([qn.expand(cfg.num_heads, -1),
                                         kn.expand(cfg.num_kv_heads, -1)]).contiguous()
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            take_experts(layer, take, p, cfg.moe)
        elif cfg.fused_checkpoint:
            layer.gate_up_w = take("mlp.gate_up_proj.weight")
            layer.down_w = take("mlp.down_proj.weight")
        else:
            layer.gate_up_w = torch.cat([take("mlp.gate_proj.weight"),
                                         take("mlp.up_proj.weight")]).contiguous()
            layer.down_w = take("mlp.down_proj.weight")
        if p:
            raise ValueError(f"unexpected weights in layer {i}: {sorted(p)}")
        return layer

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """The weights under the checkpoint's HF names (unfused unless the family
        stores them fused), for saving."""
        cfg = self.cfg
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed,
                                        "model.norm.weight": self.norm}
        if not self.tied:
            out["lm_head.weight"] = self.lm_head_proj.dense()
        q, kv, inter = self.q_size, self.kv_size, cfg.intermediate_size
        for i, L in enumerate(self.layers):
            pre = f"model.layers.{i}."
            out[pre + "input_layernorm.weight"] = L.input_norm
            if cfg.sandwich_norms:
                out |= {pre + "post_attention_layernorm.weight": L.attn_out_norm,
                        pre + "pre_feedforward_layernorm.weight": L.post_norm,
                        pre + "post_feedforward_layernorm.weight": L.mlp_out_norm}
            else:
                out[pre + "post_attention_layernorm.weight"] = L.post_norm
            if cfg.fused_checkpoint:
                out[pre + "self_attn.qkv_proj.weight"] = L.qkv_w.dense()
            else:
                wq, wk, wv = L.qkv_w.dense().split([q, kv, kv])
                out |= {pre + "self_attn.q_proj.weight": wq, pre + "self_attn.k_proj.weight": wk,
                        pre + "self_attn.v_proj.weight": wv}
            out[pre + "self_attn.o_proj.weight"] = L.o_w.dense()
            if L.qkv_b is not None:
                bq, bk, bv = L.qkv_b.split([q, kv, kv])
                out |= {pre + "self_attn.q_proj.bias": bq, pre + "self_attn.k_proj.bias": bk,
                        pre + "self_attn.v_proj.bias": bv}
            if L.qk_norm_w is not None:
                out |= {pre + "self_attn.q_norm.weight": L.qk_norm_w[0],
                        pre + "self_attn.k_norm.weight": L.qk_norm_w[cfg.num_heads]}
            if L.router_w is not None:
                out |= experts_state_dict(L, pre, cfg.moe)
            elif cfg.fused_checkpoint:
                out |= {pre + "mlp.gate_up_proj.weight": L.gate_up_w.dense(),
                        pre + "mlp.down_proj.weight": L.down_w.dense()}
            else:
                g, u = L.gate_up_w.dense().split([inter, inter])
                out |= {pre + "mlp.gate_proj.weight": g, pre + "mlp.up_proj.weight": u,
                        pre + "mlp.down_proj.weight": L.down_w.dense()}
        return {k: v.contiguous() for k, v in out.items()}

    def to_device(self, device: torch.device) -> None:
        """Move every weight (sleep level 1 on CUDA parks them in host memory)."""
        self.embed = self.embed.to(device)
        self.norm = self.norm.to(device)
        self.lm_head_proj = self.lm_head_proj.to(device)
        self.lm_head = self.embed if self.tied else None
        for layer in self.layers:
            for name in LlamaLayer.__slots__:  # tensors and Linears alike
                t = getattr(layer, name)
                if t is not None:
                    setattr(layer, name, t.to(device))
        self.cos = self.cos.to(device)
        self.sin = self.sin.to(device)
        if self.embed_scale is not None:
            self.embed_scale = self.embed_scale.to(device)
        self.device = device

    def weight_bytes(self) -> int:
        """Bytes of the weights as held (a tied model's packed LM head not counted)."""
        def size(t) -> int:
            if isinstance(t, Linear):
                bias = 0 if t.bias is None else t.bias.numel() * t.bias.element_size()
                return t.nbytes() - bias
            if isinstance(t, PackedExperts):
                return t.nbytes()
            return 0 if t is None else t.numel() * t.element_size()

        total = (size(self.embed) + size(self.norm)
                 + (0 if self.tied else self.lm_head_proj.nbytes()))
        return total + sum(size(getattr(L, name))
                           for L in self.layers for name in LlamaLayer.__slots__)

    # -- forward -----------------------------------------------------------------------
    def rotary(self, positions: torch.Tensor) -> RotaryStep:
        """This step's RoPE for every layer (Qwen2-VL's M-RoPE overrides it)."""
        return RotaryStep(self.cos, self.sin, positions)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoRABatch | None = None,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of embedding input_ids
        kv_hook: Any = None,
    ) -> torch.Tensor:
        """``kv_hook``: a KV connector's per-layer calls (kv_transfer/worker_hooks.py)."""
        cfg = self.cfg
        T = input_ids.shape[0]
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.q_size, self.kv_size
        eps, plus_one = cfg.rms_norm_eps, cfg.norm_plus_one
        windows, soft_cap = cfg.layer_windows, cfg.attn_logit_softcap
        rope = self.rotary(positions)
        # (a copy of inputs_embeds: the native residual add writes into h)
        h = (F.embedding(input_ids, self.embed) if inputs_embeds is None
             else inputs_embeds.to(device=self.device, dtype=self.dtype, copy=True))
        if self.embed_scale is not None:
            h = h * self.embed_scale
        delta: torch.Tensor | None = None  # the last block's output, not yet added to h
        qkv_t, o_t, gu_t, down_t = self._lora_targets
        for li, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if delta is None:
                x = rms_norm(h, layer.input_norm, eps, plus_one)
            else:
                h, x = add_rms_norm(h, delta, layer.input_norm, eps, plus_one)
            qkv = layer.qkv_w(x)
            if lora is not None:
                lora.apply(qkv, x, li, qkv_t)
            # q and k sit side by side in qkv: normalise and rotate both with one set of ops.
            qk = qkv[:, : q_size + kv_size].view(T, H + Hkv, D)
            if layer.qk_norm_w is not None:
                qk = rms_norm(qk, layer.qk_norm_w, eps)
            qk = rope(qk)
            v = qkv[:, q_size + kv_size :].view(T, Hkv, D)
            if kv_hook is not None:
                kv_hook.wait_for_layer_load(li)
            attn = paged_attention(qk[:, :H], qk[:, H:], v, k_cache, v_cache, meta, self.scale,
                                   sliding_window=windows[li], logits_soft_cap=soft_cap)
            if kv_hook is not None:
                kv_hook.save_kv_layer(li)
            o = layer.o_w(attn)
            if lora is not None:
                lora.apply(o, attn, li, o_t)
            if layer.attn_out_norm is not None:
                o = rms_norm(o, layer.attn_out_norm, eps, plus_one)
            h, x = add_rms_norm(h, o, layer.post_norm, eps, plus_one)
            if layer.router_w is not None:
                down = moe_mlp(x, layer.router_w, layer.experts_gate_up_w, layer.experts_down_w,
                               cfg.moe, self.act)
            else:
                gu = layer.gate_up_w(x)
                if lora is not None:
                    lora.apply(gu, x, li, gu_t)
                if self.silu:
                    act = silu_and_mul(gu)
                else:
                    gate, up = gu.chunk(2, dim=-1)
                    act = self.act(gate) * up
                down = layer.down_w(act)
                if lora is not None:
                    lora.apply(down, act, li, down_t)
            if layer.mlp_out_norm is not None:
                down = rms_norm(down, layer.mlp_out_norm, eps, plus_one)
            delta = down
        if delta is None:
            return rms_norm(h, self.norm, eps, plus_one)
        return add_rms_norm(h, delta, self.norm, eps, plus_one)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits of ``hidden``'s rows; ``float32=False`` keeps the model dtype (greedy
        sampling needs no float32 copy: the conversion is exact, the argmax the same)."""
        logits = self.lm_head_proj(hidden)
        cap = self.cfg.final_logit_softcap
        if cap:  # Gemma 2, in the model dtype as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if float32 else logits
