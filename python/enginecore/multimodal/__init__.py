"""Multimodal inputs (issue 21): wire structs, and the model-side interface."""

from enginecore.multimodal.inputs import (
    MAX_MM_ITEM_BYTES,
    MAX_MM_REQUEST_BYTES,
    MultiModalFeatureSpec,
    MultiModalTensor,
    PlaceholderRange,
    check_mm_features,
    tensor_from_wire,
    tensor_to_wire,
)

__all__ = [
    "MAX_MM_ITEM_BYTES",
    "MAX_MM_REQUEST_BYTES",
    "MultiModalFeatureSpec",
    "MultiModalTensor",
    "PlaceholderRange",
    "check_mm_features",
    "tensor_from_wire",
    "tensor_to_wire",
]
