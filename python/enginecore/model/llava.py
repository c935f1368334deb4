"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer
projector and a Llama-family decoder (model/llama.py) on the paged KV cache.

An image's ``pixel_values [1, 3, H, W]`` go through CLIP's patch conv + class
token + positions, its pre-LayerNorm and encoder layers; the hidden states of
``vision_feature_layer`` (-2: all but the last layer) without the class token
("default" strategy) are projected (Linear-GELU-Linear) to one embedding per
``<image>`` placeholder token. Weights: ``vision_tower.*``,
``multi_modal_projector.*``, ``language_model.{model,lm_head}.*`` (what
transformers 5 writes) or the in-memory ``model.{vision_tower,...}`` names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from enginecore.model.arch_config import LlamaArchConfig
from enginecore.model.llama import LlamaForCausalLM
from enginecore.model.multimodal_interface import merge_multimodal_embeddings
from enginecore.model.qwen2_vl_vision import VISION_ACTIVATIONS

ARCHITECTURE = "LlavaForConditionalGeneration"


class LlavaForConditionalGeneration(LlamaForCausalLM):
    supports_multimodal = True
    uses_mrope = False

    def __init__(self, cfg: LlamaArchConfig, hf: dict[str, Any], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        v = hf.get("vision_config") or {}
        self.v_hidden = int(v.get("hidden_size", 1024))
        self.v_heads = int(v.get("num_attention_heads", 16))
        self.v_layers = int(v.get("num_hidden_layers", 24))
        self.v_eps = float(v.get("layer_norm_eps", 1e-5))
        self.patch = int(v.get("patch_size", 14))
        self.v_act = VISION_ACTIVATIONS[v.get("hidden_act", "quick_gelu")]
        self.proj_act = VISION_ACTIVATIONS[hf.get("projector_hidden_act", "gelu")]
        self.feature_layer = int(hf.get("vision_feature_layer", -2))
        self.strategy = hf.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"{ARCHITECTURE}: vision_feature_select_strategy "
                             f"{self.strategy!r} is not supported ('default', 'full')")
        self.image_token_id = int(hf.get("image_token_index", hf.get("image_token_id", 32000)))
        self.vw: dict[str, torch.Tensor] = {}

    @classmethod
    def from_model_dir(cls, cfg: LlamaArchConfig, model_dir: str, dtype: torch.dtype,
                       device: torch.device) -> LlavaForConditionalGeneration:
        with open(os.path.join(model_dir, "config.json")) as f:
            return cls(cfg, json.load(f), dtype, device)

    # -- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split(weights))
        if "emb.patch" not in self.vw or "proj.linear_1.weight" not in self.vw:
            raise ValueError(f"{ARCHITECTURE} checkpoint lacks the vision tower or projector")

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        for raw_name, t in weights:
            name = raw_name.removeprefix("model.") if raw_name.startswith(
                ("model.vision_tower.", "model.multi_modal_projector.",
                 "model.language_model.")) else raw_name
            if name.startswith("vision_tower."):
                key = name[len("vision_tower."):].removeprefix("vision_model.")
                key = {"embeddings.patch_embedding.weight": "emb.patch",
                       "embeddings.class_embedding": "emb.cls",
                       "embeddings.position_embedding.weight": "emb.pos"}.get(key, key)
                self.vw[key] = t.to(device=self.device, dtype=self.dtype)
            elif name.startswith("multi_modal_projector."):
                self.vw["proj." + name[len("multi_modal_projector."):]] = t.to(
                    device=self.device, dtype=self.dtype)
            elif name.startswith(("language_model.lm_head.", "language_model.model.")):
                yield name[len("language_model."):], t
            elif name.startswith("language_model."):
                yield "model." + name[len("language_model."):], t
            else:
                yield name, t

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(t.numel() * t.element_size() for t in self.vw.values())

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"saving {ARCHITECTURE} weights is not supported")

    def to_device(self, device: torch.device) -> None:
        super().to_device(device)
        self.vw = {k: t.to(device) for k, t in self.vw.items()}

    # -- multimodal ----------------------------------------------------------------------
    def get_placeholder_token_id(self, modality: str) -> int:
        if modality != "image":
            raise ValueError(f"{ARCHITECTURE} takes images, not {modality!r}")
        return self.image_token_id

    @torch.inference_mode()
    def get_multimodal_embeddings(self, modality: str, pixel_values: torch.Tensor,
                                  **_: torch.Tensor) -> list[torch.Tensor]:
        self.get_placeholder_token_id(modality)
        w, E, H = self.vw, self.v_hidden, self.v_heads
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        if x.dim() == 3:
            x = x[None]
        if x.dim() != 4 or x.shape[1] != w["emb.patch"].shape[1]:
            raise ValueError(f"{ARCHITECTURE}: pixel_values {tuple(x.shape)} are not "
                             "[images, channels, height, width]")
        B = x.shape[0]
        x = F.conv2d(x, w["emb.patch"], stride=self.patch).flatten(2).transpose(1, 2)
        x = torch.cat([w["emb.cls"].expand(B, 1, E), x], dim=1)
        if x.shape[1] != w["emb.pos"].shape[0]:
            raise ValueError(f"{ARCHITECTURE}: the image gives {x.shape[1] - 1} patches, the "
                             f"vision tower takes {w['emb.pos'].shape[0] - 1}")
        x = x + w["emb.pos"]
        x = F.layer_norm(x, (E,), w["pre_layrnorm.weight"], w["pre_layrnorm.bias"], self.v_eps)
        states = [x]
        for i in range(self.v_layers):
            p = f"encoder.layers.{i}."

            def lin(name: str, h: torch.Tensor, p: str = p) -> torch.Tensor:
                return F.linear(h, w[p + name + ".weight"], w[p + name + ".bias"])

            h = F.layer_norm(x, (E,), w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"],
                             self.v_eps)
            q, k, v = (lin(f"self_attn.{n}_proj", h).view(B, -1, H, E // H).transpose(1, 2)
                       for n in ("q", "k", "v"))
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, -1, E)
            x = x + lin("self_attn.out_proj", a)
            h = F.layer_norm(x, (E,), w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"],
                             self.v_eps)
            x = x + lin("mlp.fc2", self.v_act(lin("mlp.fc1", h)))
            states.append(x)
        feats = states[self.feature_layer]
        if self.strategy == "default":
            feats = feats[:, 1:]
        out = F.linear(feats, w["proj.linear_1.weight"], w.get("proj.linear_1.bias"))
        out = F.linear(self.proj_act(out), w["proj.linear_2.weight"], w.get("proj.linear_2.bias"))
        return list(out)

    def embed_input_ids(self, input_ids: torch.Tensor,
                        multimodal_embeddings: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        if multimodal_embeddings is None or is_multimodal is None:
            return h
        return merge_multimodal_embeddings(h, multimodal_embeddings, is_multimodal)
