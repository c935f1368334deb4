"""Qwen2-VL (``Qwen2VLForConditionalGeneration``) on the paged KV cache.

The language model is the Qwen2 decoder (q/k/v biases) of model/llama.py with
M-RoPE: ``forward`` takes positions [3, T] (model/mrope.py) where a text-only
model takes [T]. Images go through the vision encoder (model/qwen2_vl_vision.py);
their embeddings replace the ``<|image_pad|>`` placeholder rows of the token
embeddings (``embed_input_ids``), as transformers' ``masked_scatter`` does.

Checkpoints: transformers 5 saves the decoder as ``model.layers...`` and the
encoder as ``visual...`` (the 4.x layout); the 5.x in-memory names
``model.language_model...`` / ``model.visual...`` load too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from enginecore.model.arch_config import LlamaArchConfig
from enginecore.model.llama import LlamaForCausalLM
from enginecore.model.mrope import (
    MRotaryStep,
    mrope_column_rows,
    mrope_input_positions,
    positions_with_delta,
)
from enginecore.model.qwen2_vl_vision import Qwen2VisionConfig, Qwen2VisionEncoder
from enginecore.model.rope import RotaryStep

ARCHITECTURE = "Qwen2VLForConditionalGeneration"
# Qwen2-VL's token ids (transformers' Qwen2VLConfig defaults)
_TOKEN_DEFAULTS = {"image_token_id": 151655, "video_token_id": 151656,
                   "vision_start_token_id": 151652, "vision_end_token_id": 151653}


@dataclass
class Qwen2VLConfig:
    """What Qwen2-VL adds to the decoder's LlamaArchConfig."""

    vision: Qwen2VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen2VLConfig:
        tokens = {k: int(cfg.get(k, v)) for k, v in _TOKEN_DEFAULTS.items()}
        return cls(vision=Qwen2VisionConfig.from_hf(cfg.get("vision_config") or {}), **tokens)

    @classmethod
    def load(cls, model_dir: str) -> Qwen2VLConfig:
        with open(os.path.join(model_dir, "config.json")) as f:
            return cls.from_hf(json.load(f))

    @property
    def spatial_merge_size(self) -> int:
        return self.vision.spatial_merge_size

    def num_image_tokens(self, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens of one image (or video) with this patch grid."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // self.spatial_merge_size**2


def split_image_items(pixel_values: torch.Tensor,
                      image_grid_thw: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """The image processor's batch (all images' patches stacked) as one item per
    image: its ``pixel_values`` rows and its ``image_grid_thw`` [1, 3]
    (vLLM's flat field, split by ``grid.prod()``)."""
    grids = image_grid_thw.reshape(-1, 3)
    sizes = grids.prod(-1).tolist()
    if sum(sizes) != pixel_values.shape[0]:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, the grids "
                         f"{grids.tolist()} need {sum(sizes)}")
    return [{"pixel_values": pv, "image_grid_thw": g[None]}
            for pv, g in zip(pixel_values.split(sizes), grids)]


def _split_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                      visual: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's tensors under the names LlamaForCausalLM takes; the encoder's
    (``visual.`` stripped) collected into ``visual``."""
    for name, t in weights:
        if name.startswith("visual."):
            visual.append((name[len("visual."):], t))
        elif name.startswith("model.visual."):
            visual.append((name[len("model.visual."):], t))
        elif name.startswith("model.language_model."):
            yield "model." + name[len("model.language_model."):], t
        else:
            yield name, t


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    supports_multimodal = True
    uses_mrope = True

    def __init__(self, cfg: LlamaArchConfig, mm: Qwen2VLConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        if not cfg.mrope_section:
            raise ValueError(f"{ARCHITECTURE} config lacks rope_parameters.mrope_section")
        super().__init__(cfg, dtype, device)
        self.mm = mm
        self.visual = Qwen2VisionEncoder(mm.vision, dtype, device)
        if mm.vision.hidden_size != cfg.hidden_size:
            raise ValueError(f"vision_config.hidden_size {mm.vision.hidden_size} != the language "
                             f"model's hidden_size {cfg.hidden_size}")
        self.mrope_rows = mrope_column_rows(cfg.mrope_section, cfg.rotary_dim).to(device)

    @classmethod
    def from_model_dir(cls, cfg: LlamaArchConfig, model_dir: str, dtype: torch.dtype,
                       device: torch.device) -> Qwen2VLForConditionalGeneration:
        return cls(cfg, Qwen2VLConfig.load(model_dir), dtype, device)

    # -- weights ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        visual: list[tuple[str, torch.Tensor]] = []
        super().load_weights(_split_checkpoint(weights, visual))
        self.visual.load_weights(visual)

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"saving {ARCHITECTURE} weights is not supported")

    def to_device(self, device: torch.device) -> None:
        super().to_device(device)
        self.visual.to_device(device)
        self.mrope_rows = self.mrope_rows.to(device)

    def weight_bytes(self) -> int:
        return super().weight_bytes() + self.visual.weight_bytes()

    # -- multimodal --------------------------------------------------------------------
    def embed_multimodal(
        self, pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]],
    ) -> list[torch.Tensor]:
        """The vision encoder on one or more images: [tokens_i, hidden] per image."""
        grids = image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) \
            else [list(g) for g in image_grid_thw]
        if grids and not isinstance(grids[0], list):  # one image's (t, h, w)
            grids = [grids]
        return self.visual.forward(pixel_values, grids)

    def get_placeholder_token_id(self, modality: str) -> int:
        if modality != "image":
            raise ValueError(f"{ARCHITECTURE} here takes images, not {modality!r}")
        return self.mm.image_token_id

    def get_multimodal_embeddings(self, modality: str, pixel_values: torch.Tensor,
                                  image_grid_thw: torch.Tensor, **_: torch.Tensor
                                  ) -> list[torch.Tensor]:
        """The model runner's entry (SupportsMultiModal): one item per call or a batch."""
        self.get_placeholder_token_id(modality)
        return self.embed_multimodal(pixel_values, image_grid_thw.reshape(-1, 3))

    def embed_input_ids(self, input_ids: torch.Tensor,
                        multimodal_embeddings: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [T, hidden] with the rows where ``is_multimodal`` holds
        replaced, in order, by ``multimodal_embeddings`` [n, hidden]."""
        h = torch.nn.functional.embedding(input_ids, self.embed)
        if multimodal_embeddings is None or is_multimodal is None:
            return h
        n = int(is_multimodal.sum())
        if n != multimodal_embeddings.shape[0]:
            raise ValueError(f"{n} placeholder tokens but {multimodal_embeddings.shape[0]} "
                             "image embeddings")
        h[is_multimodal] = multimodal_embeddings.to(h.dtype)
        return h

    def get_mrope_input_positions(self, num_tokens: int,
                                  placeholders: Sequence[tuple[int, Sequence[int]]]
                                  ) -> tuple[np.ndarray, int]:
        """[3, num_tokens] positions of a prompt and its rope delta, from each
        item's (placeholder offset, grid_thw) (vLLM's method of this name)."""
        for _offset, grid in placeholders:
            if len(grid) != 3:
                raise ValueError(f"image_grid_thw {list(grid)} is not (t, h, w)")
        return mrope_input_positions(num_tokens, placeholders, self.mm.spatial_merge_size)

    @staticmethod
    def positions_past_prompt(start: int, end: int, delta: int) -> np.ndarray:
        return positions_with_delta(start, end, delta)

    # -- forward -------------------------------------------------------------------------
    def rotary(self, positions: torch.Tensor) -> RotaryStep | MRotaryStep:
        """[3, T] positions: M-RoPE. [T] (text only, dummy batches): the three rows
        would be equal, which is plain RoPE."""
        if positions.dim() == 2:
            return MRotaryStep(self.cos, self.sin, positions, self.mrope_rows)
        return super().rotary(positions)
