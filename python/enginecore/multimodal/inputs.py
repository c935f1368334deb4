"""Multimodal items on the wire, in vLLM's ``MultiModalFeatureSpec`` shape.

A processed item (for an image: the HF processor's ``pixel_values`` and friends)
travels as raw tensor bytes + dtype + shape in msgspec structs, never pickled.
``data`` is None when the front-end's sender cache knows the engine already
holds the item; the engine's receiver cache then fills it in by ``identifier``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec

from enginecore.bounds import NonNegInt64, PositiveInt64

# Items per prompt by modality when limit_mm_per_prompt does not name the modality.
MM_DEFAULT_LIMIT_PER_PROMPT = 999

if TYPE_CHECKING:
    import torch

# One processed item and all items of one request: bounds the engine checks
# after decoding, before any tensor is built (a peer cannot make it allocate more).
MAX_MM_ITEM_BYTES = 256 << 20
MAX_MM_REQUEST_BYTES = 1 << 30

# Only plain numeric dtypes cross the wire; their torch names are the wire names,
# with their sizes in bytes (torch is imported only where tensors are built, so
# the wire structs stay light for processes that only route them).
_DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)
ModalityName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
Identifier = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class MultiModalTensor(msgspec.Struct, array_like=True, frozen=True):  # type: ignore[call-arg]
    """One tensor as C-contiguous bytes; ``dtype`` is a key of the dtype table."""

    dtype: str
    shape: list[NonNegInt64]
    data: bytes


class PlaceholderRange(msgspec.Struct, array_like=True, frozen=True):  # type: ignore[call-arg]
    """vLLM's PlaceholderRange: the item's tokens are prompt[offset : offset + length]."""

    offset: NonNegInt64
    length: PositiveInt64

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of the item's tokens lies in ``[start, end)``."""
        return self.offset < end and start < self.offset + self.length


class MultiModalFeatureSpec(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """vLLM's MultiModalFeatureSpec: one item (an image) of one request.

    ``identifier`` is the content hash of the processed item: the key of the
    receiver cache, the encoder cache and the block hashes' extra keys.
    ``data`` maps the processor's output names (``pixel_values``, ...) to tensors;
    None when the engine already holds the item.
    """

    modality: ModalityName
    identifier: Identifier
    mm_position: PlaceholderRange
    data: dict[str, MultiModalTensor] | None = None


def tensor_to_wire(tensor: torch.Tensor) -> MultiModalTensor:
    """``tensor`` as wire bytes (copied to CPU, C-contiguous)."""
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(
            f"multimodal tensor dtype {tensor.dtype} is not supported: {sorted(_DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous()
    # Bytes through a uint8 view: numpy has no bfloat16.
    raw = flat.reshape(-1).view(torch.uint8).numpy().tobytes()
    return MultiModalTensor(name, list(flat.shape), raw)


def tensor_nbytes(item: MultiModalTensor) -> int:
    """The bytes ``item`` must hold for its dtype and shape."""
    count = 1
    for dim in item.shape:
        count *= dim
    return count * _DTYPES[item.dtype]


def tensor_from_wire(item: MultiModalTensor) -> torch.Tensor:
    """The tensor ``item`` carries; ``ValueError`` for an unknown dtype or a size mismatch."""
    import torch

    if item.dtype not in _DTYPES:
        raise ValueError(
            f"multimodal tensor dtype {item.dtype!r} is not supported: {sorted(_DTYPES)}")
    if tensor_nbytes(item) != len(item.data):
        raise ValueError(
            f"multimodal tensor of shape {item.shape} {item.dtype} needs "
            f"{tensor_nbytes(item)} bytes, got {len(item.data)}"
        )
    dtype = _torch_dtype(item.dtype)
    if not item.data:
        return torch.empty(item.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(item.data), dtype=dtype)
    return flat.reshape(item.shape)


def check_mm_features(
    features: list[MultiModalFeatureSpec] | None,
    num_prompt_tokens: int,
    max_item_bytes: int = MAX_MM_ITEM_BYTES,
    max_request_bytes: int = MAX_MM_REQUEST_BYTES,
) -> None:
    """``ValueError`` naming the problem for items a request cannot carry: unknown
    dtype, bytes that do not match a shape, an item over ``max_item_bytes``, a
    request over ``max_request_bytes``, a placeholder outside the prompt, or two
    placeholders that overlap."""
    if not features:
        return
    total = 0
    previous_end = 0
    for index, feature in enumerate(sorted(features, key=lambda f: f.mm_position.offset)):
        position = feature.mm_position
        if position.offset + position.length > num_prompt_tokens:
            raise ValueError(
                f"mm_features: item {feature.identifier!r} placeholder "
                f"[{position.offset}, {position.offset + position.length}) "
                f"is outside the prompt of {num_prompt_tokens} tokens"
            )
        if index and position.offset < previous_end:
            raise ValueError(f"mm_features: item {feature.identifier!r} overlaps another "
                             "item's placeholder")
        previous_end = position.offset + position.length
        item_bytes = 0
        for name, tensor in (feature.data or {}).items():
            if tensor.dtype not in _DTYPES:
                raise ValueError(f"mm_features: {name} dtype {tensor.dtype!r} is not "
                                 f"supported: {sorted(_DTYPES)}")
            if tensor_nbytes(tensor) != len(tensor.data):
                raise ValueError(f"mm_features: {name} bytes do not match shape "
                                 f"{tensor.shape} {tensor.dtype}")
            item_bytes += len(tensor.data)
        if item_bytes > max_item_bytes:
            raise ValueError(f"mm_features: item {feature.identifier!r} is {item_bytes} "
                             f"bytes, over {max_item_bytes}")
        total += item_bytes
    if total > max_request_bytes:
        raise ValueError(f"mm_features: request carries {total} bytes, over {max_request_bytes}")
