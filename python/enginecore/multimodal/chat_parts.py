"""Images in chat messages: OpenAI's ``image_url`` content parts (and vLLM's
``image_pil`` for ``LLM.chat``) become ``{"type": "image"}`` parts the chat
template places its image token for, plus the decoded images in order."""

from __future__ import annotations

from typing import Any

from enginecore.multimodal.media import MediaLimits, checked_image, image_from_url

IMAGE_PART_TYPES = frozenset({"image_url", "image_pil", "image"})


def has_image_parts(messages: Any) -> bool:
    if not isinstance(messages, (list, tuple)):
        return False
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content):
            return True
    return False


def extract_images(messages: list[dict[str, Any]], limits: MediaLimits
                   ) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with each image part as ``{"type": "image"}``, the images)."""
    images: list[Any] = []
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            images.append(_image_of(part, kind, limits, i))
            parts.append({"type": "image"})
        out.append({**msg, "content": parts})
    return out, images


def _image_of(part: dict[str, Any], kind: str, limits: MediaLimits, index: int) -> Any:
    from PIL import Image

    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, dict) else value
        return image_from_url(url, limits)
    if isinstance(value, Image.Image):
        return checked_image(value, limits)
    raise ValueError(f"messages[{index}]: a {kind!r} part needs a PIL image under {kind!r}")
