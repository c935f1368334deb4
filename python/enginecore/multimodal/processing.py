"""Prompt + images -> expanded token ids + ``MultiModalFeatureSpec`` items, with
the model's own HF image processor (``AutoImageProcessor`` from the model folder).

The prompt holds one placeholder token per image (the chat template writes it:
Qwen2-VL's ``<|image_pad|>`` between its vision start / end tokens, LLaVA's
``<image>``); each is expanded to as many tokens as the vision encoder gives
that image embeddings, as the HF processor does in text (the placeholder is a
special token, so expanding ids equals expanding text). A run that already has
the expanded length is kept (prompt_token_ids from a processor). Each item's
identifier is the sha256 of its processed tensors, so the same image gives the
same identifier in any request, and different pixels never share one.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from enginecore.multimodal.inputs import (
    MM_DEFAULT_LIMIT_PER_PROMPT,
    MultiModalFeatureSpec,
    MultiModalTensor,
    PlaceholderRange,
    tensor_to_wire,
)
from enginecore.multimodal.media import MediaLimits, checked_image, image_from_bytes

# The architectures whose prompts the front-end expands (model/mm_registry.py
# lists what the runner runs).
QWEN2_VL = "Qwen2VLForConditionalGeneration"
LLAVA = "LlavaForConditionalGeneration"
SUPPORTED_ARCHITECTURES = (LLAVA, QWEN2_VL)


def feature_identifier(data: dict[str, MultiModalTensor]) -> str:
    """sha256 over the item's tensors in name order: name, (dtype, shape), bytes."""
    digest = hashlib.sha256()
    for name in sorted(data):
        t = data[name]
        digest.update(name.encode() + repr((t.dtype, t.shape)).encode() + t.data)
    return digest.hexdigest()


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of ``token_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class MultiModalProcessor:
    """One model's image processing; ``create`` returns None for text-only models."""

    def __init__(self, model_dir: str, hf_config: dict[str, Any], limits: MediaLimits,
                 limit_per_prompt: dict[str, int]) -> None:
        import transformers

        self.architecture = (hf_config.get("architectures") or [""])[0]
        self.limits = limits
        self.limit_per_prompt = dict(limit_per_prompt)
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        if self.architecture == QWEN2_VL:
            self.image_token_id = int(hf_config["image_token_id"])
            self.merge_size = int(getattr(self.image_processor, "merge_size", 2))
        else:
            self.image_token_id = int(hf_config.get("image_token_index",
                                                    hf_config.get("image_token_id", 32000)))
            vision = hf_config.get("vision_config") or {}
            self.patch_size = int(vision.get("patch_size", 14))
            # CLIP's CLS token: kept with "full", dropped with "default".
            self.extra_tokens = 1 if hf_config.get(
                "vision_feature_select_strategy", "default") == "full" else 0

    @classmethod
    def create(cls, model_dir: str | None, mm_config: Any) -> MultiModalProcessor | None:
        """The processor of the model in ``model_dir``, or None when it takes no images."""
        if not model_dir or not os.path.isdir(model_dir):
            return None
        try:
            with open(os.path.join(model_dir, "config.json")) as f:
                hf_config = json.load(f)
        except (OSError, ValueError):
            return None
        architecture = (hf_config.get("architectures") or [""])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            return None
        return cls(model_dir, hf_config, MediaLimits.from_config(mm_config),
                   mm_config.limit_mm_per_prompt)

    # -- items --------------------------------------------------------------------------
    def limit(self, modality: str) -> int:
        return self.limit_per_prompt.get(modality, MM_DEFAULT_LIMIT_PER_PROMPT)

    def check_count(self, modality: str, count: int) -> None:
        if count > self.limit(modality):
            raise ValueError(f"At most {self.limit(modality)} {modality}(s) may be provided in "
                             f"one prompt, got {count} (limit_mm_per_prompt)")

    def images(self, mm_data: Any) -> list[Any]:
        """The PIL images of a prompt's ``multi_modal_data``, checked."""
        if not isinstance(mm_data, dict):
            raise TypeError(f"multi_modal_data must be a dict, got {type(mm_data).__name__}")
        unknown = set(mm_data) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modalities {sorted(unknown)}; "
                             "this model takes 'image'")
        items = mm_data.get("image")
        if items is None:
            return []
        items = list(items) if isinstance(items, (list, tuple)) else [items]
        self.check_count("image", len(items))
        return [self._image(item) for item in items]

    def _image(self, item: Any) -> Any:
        from PIL import Image

        if isinstance(item, Image.Image):
            return checked_image(item, self.limits)
        if isinstance(item, (bytes, bytearray)):
            return image_from_bytes(bytes(item), self.limits)
        raise TypeError(f"an image is a PIL.Image or encoded bytes, got {type(item).__name__}")

    def process_images(self, images: list[Any]) -> list[tuple[dict[str, Any], int]]:
        """Per image: its processed tensors (the model's forward names) and its number
        of placeholder tokens."""
        if not images:
            return []
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - the processor refuses odd sizes in its own words
            raise ValueError(f"the image processor cannot process the image: {e}") from None
        if self.architecture == QWEN2_VL:
            grids = out["image_grid_thw"].reshape(-1, 3)
            sizes = grids.prod(-1).tolist()
            return [({"pixel_values": pv, "image_grid_thw": g[None]}, n // self.merge_size**2)
                    for pv, g, n in zip(out["pixel_values"].split(sizes), grids, sizes)]
        pixels = out["pixel_values"]
        height, width = pixels.shape[-2:]
        count = (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens
        return [({"pixel_values": pv[None]}, count) for pv in pixels]

    # -- prompts --------------------------------------------------------------------------
    def process(self, token_ids: list[int], mm_data: Any
                ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """``token_ids`` with each image's placeholder expanded, and its items."""
        items = self.process_images(self.images(mm_data))
        runs = placeholder_runs(token_ids, self.image_token_id)
        if len(runs) != len(items):
            raise ValueError(f"the prompt has {len(runs)} image placeholder(s) (token id "
                             f"{self.image_token_id}) for {len(items)} image(s)")
        ids: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        cursor = 0
        for (offset, length), (tensors, count) in zip(runs, items):
            if length not in (1, count):
                raise ValueError(f"an image placeholder of {length} tokens: an image here "
                                 f"takes 1 (expanded here) or {count}")
            ids.extend(token_ids[cursor:offset])
            data = {name: tensor_to_wire(t) for name, t in sorted(tensors.items())}
            features.append(MultiModalFeatureSpec(
                "image", feature_identifier(data), PlaceholderRange(len(ids), count), data))
            ids.extend([self.image_token_id] * count)
            cursor = offset + length
        ids.extend(token_ids[cursor:])
        return ids, features


def check_no_images(mm_data: Any, model: str) -> None:
    """The error for images sent to a model that takes none."""
    if mm_data:
        raise ValueError(f"the model {model} does not take images: image inputs are not "
                         "supported for a text-only model (supported multimodal "
                         f"architectures: {list(SUPPORTED_ARCHITECTURES)})")
