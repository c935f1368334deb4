"""The vision-language architectures the model runner runs (no torch here: the
engine core checks requests against it before any model code is imported)."""

from __future__ import annotations

# architecture (config.json) -> the module and class that run it
MULTIMODAL_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("enginecore.model.llava", "LlavaForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("enginecore.model.qwen2_vl",
                                        "Qwen2VLForConditionalGeneration"),
}


def is_multimodal_architecture(architecture: str) -> bool:
    return architecture in MULTIMODAL_ARCHITECTURES


def unsupported_multimodal_error(architecture: str) -> ValueError:
    """The error for a vision-language checkpoint this project does not run."""
    return ValueError(f"multimodal architecture {architecture!r} is not supported; supported "
                      f"multimodal architectures: {sorted(MULTIMODAL_ARCHITECTURES)}")
