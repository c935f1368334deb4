"""BERT-family encoder (e.g. all-MiniLM-L6-v2) for the pooling task: whole
sequences in, one pooled (mean or CLS), optionally normalised vector out."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from enginecore.model.linear import Linear, packing_enabled

logger = logging.getLogger(__name__)

ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification")


@dataclass
class BertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float


@dataclass
class PoolerConfig:
    mode: str = "mean"  # "mean" or "cls"
    normalize: bool = True


def is_encoder_config(cfg: dict) -> bool:
    return any(a in ENCODER_ARCHITECTURES for a in cfg.get("architectures") or ())


def load_bert_config(model_dir: str) -> BertConfig:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} for BERT; need gelu")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("only absolute position embeddings are supported for BERT")
    return BertConfig(
        hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"], intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["max_position_embeddings"],
        type_vocab_size=cfg.get("type_vocab_size", 2),
        layer_norm_eps=cfg.get("layer_norm_eps", 1e-12))


def load_pooler_config(model_dir: str) -> PoolerConfig:
    """sentence-transformers layout: 1_Pooling/config.json and a Normalize module."""
    pooler = PoolerConfig(mode="cls", normalize=False)
    path = os.path.join(model_dir, "1_Pooling", "config.json")
    if os.path.exists(path):
        with open(path) as f:
            p = json.load(f)
        if p.get("pooling_mode_mean_tokens"):
            pooler.mode = "mean"
        elif p.get("pooling_mode_cls_token"):
            pooler.mode = "cls"
        else:
            raise ValueError(f"unsupported pooling mode in {path}; supported: mean, cls")
    modules = os.path.join(model_dir, "modules.json")
    if os.path.exists(modules):
        with open(modules) as f:
            pooler.normalize = any(m.get("type", "").endswith("Normalize") for m in json.load(f))
    return pooler


class BertLayer:
    # The four projections are ``Linear``s (bias inside), packed for the CPU GEMM.
    __slots__ = ("qkv", "o", "up", "down", "ln1_w", "ln1_b", "ln2_w", "ln2_b")


class BertEncoder:
    def __init__(self, cfg: BertConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.layers: list[BertLayer] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        w: dict[str, torch.Tensor] = {}
        for raw_name, t in weights:
            name = raw_name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.", "classifier.")) or name.endswith("position_ids"):
                continue
            w[name] = t.to(device=self.device, dtype=self.dtype)

        def take(key: str) -> torch.Tensor:
            try:
                return w.pop(key)
            except KeyError:
                raise ValueError(f"checkpoint lacks {key}") from None

        self.word = take("embeddings.word_embeddings.weight")
        self.pos = take("embeddings.position_embeddings.weight")
        self.type = take("embeddings.token_type_embeddings.weight")
        self.emb_ln_w = take("embeddings.LayerNorm.weight")
        self.emb_ln_b = take("embeddings.LayerNorm.bias")
        self.layers = []
        pack = packing_enabled(self.dtype, self.device)
        for i in range(self.cfg.num_layers):
            p = f"encoder.layer.{i}."
            L = BertLayer()
            L.qkv = Linear(torch.cat([take(p + f"attention.self.{n}.weight")
                                      for n in ("query", "key", "value")]).contiguous(),
                           torch.cat([take(p + f"attention.self.{n}.bias")
                                      for n in ("query", "key", "value")]).contiguous(), pack)
            L.o = Linear(take(p + "attention.output.dense.weight"),
                         take(p + "attention.output.dense.bias"), pack)
            L.ln1_w, L.ln1_b = take(p + "attention.output.LayerNorm.weight"), take(
                p + "attention.output.LayerNorm.bias")
            L.up = Linear(take(p + "intermediate.dense.weight"),
                          take(p + "intermediate.dense.bias"), pack)
            L.down = Linear(take(p + "output.dense.weight"), take(p + "output.dense.bias"), pack)
            L.ln2_w, L.ln2_b = take(p + "output.LayerNorm.weight"), take(
                p + "output.LayerNorm.bias")
            self.layers.append(L)
        if w:
            raise ValueError(f"unexpected weights: {sorted(w)[:5]}")

    def weight_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in (self.word, self.pos, self.type))
        for L in self.layers:
            n += sum(lin.nbytes() for lin in (L.qkv, L.o, L.up, L.down))
            n += sum(t.numel() * t.element_size() for t in (L.ln1_w, L.ln1_b, L.ln2_w, L.ln2_b))
        return n

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """input_ids [B, Lmax] (padded); returns hidden states [B, Lmax, H]."""
        cfg = self.cfg
        B, Lmax = input_ids.shape
        H, nh = cfg.hidden_size, cfg.num_heads
        hd = H // nh
        eps = cfg.layer_norm_eps
        pos = torch.arange(Lmax, device=self.device)
        x = F.embedding(input_ids, self.word) + self.pos[pos][None] + self.type[0]
        x = F.layer_norm(x, (H,), self.emb_ln_w, self.emb_ln_b, eps)
        lens = torch.tensor(lengths, device=self.device)
        mask = (pos[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, Lmax]
        for L in self.layers:
            qkv = L.qkv(x).view(B, Lmax, 3, nh, hd)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            a = a.transpose(1, 2).reshape(B, Lmax, H)
            x = F.layer_norm(L.o(a) + x, (H,), L.ln1_w, L.ln1_b, eps)
            h = F.gelu(L.up(x))
            x = F.layer_norm(L.down(h) + x, (H,), L.ln2_w, L.ln2_b, eps)
        return x


def pool(hidden: torch.Tensor, lengths: list[int], pooler: PoolerConfig) -> torch.Tensor:
    """[B, Lmax, H] -> [B, H]: mean over real tokens (or CLS), then L2-normalised."""
    if pooler.mode == "cls":
        out = hidden[:, 0].float()
    else:
        Lmax = hidden.shape[1]
        lens = torch.tensor(lengths, device=hidden.device)
        m = (torch.arange(Lmax, device=hidden.device)[None, :] < lens[:, None]).to(torch.float32)
        out = (hidden.float() * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1e-9)
    if pooler.normalize:
        out = F.normalize(out, p=2, dim=-1)
    return out
