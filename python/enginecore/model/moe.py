"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE), as transformers computes it.

Router: logits = x W_r^T; softmax in float32; top-k; optionally renormalised
to sum to one; Qwen3-MoE then casts the weights to the model dtype, Mixtral
keeps them in float32. Each expert is a gated MLP (act(x W_g^T) * x W_u^T) W_d^T
over the tokens routed to it, scaled by their routing weight and added into
the output expert by expert in ascending order (each token meets an expert at
most once, so the sum per token runs in the same order as transformers' loop).

Tokens are grouped by expert with one stable sort and one host read of the
per-expert counts, instead of a device sync per expert.

Where the dense layers' weights are packed for the CPU GEMM (model/linear.py),
each expert's are too (``PackedExperts``): on an AVX2-only CPU torch's bf16
matmul ran ~3x slower than float32, and bf16 is the default dtype there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from enginecore.model.arch_config import MoEConfig
from enginecore.model.linear import Linear


class PackedExperts:
    """One projection of every expert, each a ``Linear`` packed for the CPU GEMM.
    Indexing gives an expert's plain weight back (for saving); the stacked
    tensor is not kept."""

    __slots__ = ("linears",)

    def __init__(self, stacked: torch.Tensor | list[Linear], pack: str | None = None) -> None:
        self.linears = (stacked if isinstance(stacked, list)
                        else [Linear(w, pack=pack) for w in stacked.unbind(0)])

    def __len__(self) -> int:
        return len(self.linears)

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.linears[e].dense()

    def to(self, device: torch.device) -> PackedExperts:
        """The experts on `device`, each packed as that device packs (``Linear.to``):
        plain on a GPU, packed again back on the CPU."""
        return PackedExperts([lin.to(device) for lin in self.linears])

    def nbytes(self) -> int:
        return sum(lin.nbytes() for lin in self.linears)


def pack_experts(stacked: torch.Tensor, pack: str | None) -> PackedExperts | torch.Tensor:
    """[E, N, K] expert weights as ``PackedExperts`` where `pack` says so, else as they are."""
    return stacked if pack is None or stacked.numel() == 0 else PackedExperts(stacked, pack)


def _project(weights: PackedExperts | torch.Tensor, e: int, x: torch.Tensor) -> torch.Tensor:
    if isinstance(weights, PackedExperts):
        return weights.linears[e](x)
    return F.linear(x, weights[e])


def moe_mlp(
    x: torch.Tensor,  # [T, hidden]
    router_w: torch.Tensor,  # [E, hidden]
    gate_up_w: PackedExperts | torch.Tensor,  # [E, 2 * inter, hidden] (gate rows, then up)
    down_w: PackedExperts | torch.Tensor,  # [E, hidden, inter]
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
        gate, up = _project(gate_up_w, e, x.index_select(0, tok)).chunk(2, dim=-1)
        h = _project(down_w, e, act(gate) * up) * weights[start : start + n, None]
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
