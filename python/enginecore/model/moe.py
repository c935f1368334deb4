"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE), as transformers computes it.

Router: logits = x W_r^T; softmax in float32; top-k; optionally renormalised
to sum to one; Qwen3-MoE then casts the weights to the model dtype, Mixtral
keeps them in float32. Each expert is a gated MLP (act(x W_g^T) * x W_u^T) W_d^T
over the tokens routed to it, scaled by their routing weight and added into
the output expert by expert in ascending order (each token meets an expert at
most once, so the sum per token runs in the same order as transformers' loop).

Tokens are grouped by expert with one stable sort and one host read of the
per-expert counts, instead of a device sync per expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from enginecore.model.arch_config import MoEConfig


def moe_mlp(
    x: torch.Tensor,  # [T, hidden]
    router_w: torch.Tensor,  # [E, hidden]
    gate_up_w: torch.Tensor,  # [E, 2 * inter, hidden] (gate rows, then up rows)
    down_w: torch.Tensor,  # [E, hidden, inter]
    cfg: MoEConfig,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    T = x.shape[0]
    k = cfg.top_k
    probs = torch.softmax(F.linear(x, router_w), dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    if cfg.normalize_top_k:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if cfg.weights_in_model_dtype:
        top_w = top_w.to(x.dtype)
    out = torch.zeros_like(x)
    if T == 0:
        return out
    flat_experts = top_i.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=cfg.num_experts).tolist()
    tokens = order // k
    weights = top_w.reshape(-1).index_select(0, order)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[start : start + n]
        gate, up = F.linear(x.index_select(0, tok), gate_up_w[e]).chunk(2, dim=-1)
        h = F.linear(act(gate) * up, down_w[e]) * weights[start : start + n, None]
        out.index_add_(0, tok, h.to(out.dtype))
        start += n
    return out


# -- checkpoint names -------------------------------------------------------------------
# On disk (the Hub's and transformers' save_pretrained format) each expert has its own
# tensors; they are stacked here into [E, 2I, hidden] and [E, hidden, I].
_NAMES = {  # naming -> (block prefix, gate, up, down)
    "mixtral": ("block_sparse_moe.", "w1", "w3", "w2"),
    "qwen": ("mlp.", "gate_proj", "up_proj", "down_proj"),
}


def take_experts(layer, take: Callable[[str], torch.Tensor], remaining: dict,
                 cfg: MoEConfig) -> None:
    block, gate, up, down = _NAMES[cfg.naming]
    layer.router_w = take(block + "gate.weight")
    fused = block + "experts.gate_up_proj"
    if fused in remaining:  # transformers' in-memory layout, already stacked
        layer.experts_gate_up_w = take(fused).contiguous()
        layer.experts_down_w = take(block + "experts.down_proj").contiguous()
        return
    ex = block + "experts."
    layer.experts_gate_up_w = torch.stack([
        torch.cat([take(f"{ex}{e}.{gate}.weight"), take(f"{ex}{e}.{up}.weight")])
        for e in range(cfg.num_experts)])
    layer.experts_down_w = torch.stack([take(f"{ex}{e}.{down}.weight")
                                        for e in range(cfg.num_experts)])


def experts_state_dict(layer, prefix: str, cfg: MoEConfig) -> dict[str, torch.Tensor]:
    block, gate, up, down = _NAMES[cfg.naming]
    out = {prefix + block + "gate.weight": layer.router_w}
    ex = prefix + block + "experts."
    inter = cfg.intermediate_size
    for e in range(cfg.num_experts):
        g, u = layer.experts_gate_up_w[e].split([inter, inter])
        out |= {f"{ex}{e}.{gate}.weight": g, f"{ex}{e}.{up}.weight": u,
                f"{ex}{e}.{down}.weight": layer.experts_down_w[e]}
    return out
