"""Multimodal items on the wire: tensors as raw bytes + dtype + shape (no pickle),
bounds checked before any tensor is built, and the embedding merge."""

import msgspec
import pytest
import torch

from enginecore.model.multimodal_interface import merge_multimodal_embeddings
from enginecore.multimodal import (
    MultiModalFeatureSpec,
    PlaceholderRange,
    check_mm_features,
    tensor_from_wire,
    tensor_to_wire,
)
from enginecore.protocol import EngineCoreRequest, decode_request, encode_request


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.uint8, torch.bool])
def test_tensor_round_trip_is_exact(dtype):
    source = (torch.randn(2, 3, 5) * 10).to(dtype)
    back = tensor_from_wire(tensor_to_wire(source))
    assert back.dtype == dtype and back.shape == source.shape
    assert torch.equal(back, source)


def test_request_with_features_round_trips_through_the_engine_decoder():
    pixels = torch.randn(1, 3, 8, 8)
    feature = MultiModalFeatureSpec("image", "hash-a", PlaceholderRange(1, 4),
                                    {"pixel_values": tensor_to_wire(pixels)})
    cached = MultiModalFeatureSpec("image", "hash-b", PlaceholderRange(6, 4))
    request = EngineCoreRequest("r", list(range(12)), mm_features=[feature, cached])
    decoded = decode_request(encode_request(msgspec.msgpack.Encoder(), request))
    assert decoded.mm_features[1].data is None
    assert decoded.mm_features[0].identifier == "hash-a"
    assert torch.equal(tensor_from_wire(decoded.mm_features[0].data["pixel_values"]), pixels)
    check_mm_features(decoded.mm_features, len(decoded.prompt_token_ids))
    # Requests without items keep their old bytes (the field is omitted).
    plain = EngineCoreRequest("r", [1, 2])
    assert msgspec.msgpack.encode(plain) == msgspec.msgpack.encode(
        EngineCoreRequest("r", [1, 2], mm_features=None))


def test_bad_items_are_value_errors_naming_the_problem():
    good = tensor_to_wire(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="outside the prompt"):
        check_mm_features([MultiModalFeatureSpec("image", "a", PlaceholderRange(8, 4))], 10)
    with pytest.raises(ValueError, match="overlaps"):
        check_mm_features(
            [MultiModalFeatureSpec("image", "a", PlaceholderRange(0, 4)),
             MultiModalFeatureSpec("image", "b", PlaceholderRange(2, 4))], 10
        )
    short = msgspec.structs.replace(good, data=good.data[:-1])
    with pytest.raises(ValueError, match="do not match shape"):
        check_mm_features([MultiModalFeatureSpec("image", "a", PlaceholderRange(0, 4),
                                                 {"pixel_values": short})], 10)
    with pytest.raises(ValueError, match="not supported"):
        tensor_from_wire(msgspec.structs.replace(good, dtype="object"))
    with pytest.raises(ValueError, match="over 8"):
        check_mm_features([MultiModalFeatureSpec("image", "a", PlaceholderRange(0, 4),
                                                 {"x": good})], 10, max_item_bytes=8)
    with pytest.raises(ValueError, match="request carries"):
        check_mm_features(
            [MultiModalFeatureSpec("image", "a", PlaceholderRange(0, 2), {"x": good}),
             MultiModalFeatureSpec("image", "b", PlaceholderRange(2, 2), {"x": good})],
            10,
            max_request_bytes=20,
        )
    with pytest.raises(ValueError, match="mm_features"):
        decode_request(msgspec.msgpack.encode(
            ["r", [1], None, 0.0, None, None, None, 0, 0, 0, None, None,
             [["image", "", [0, 1]]]]))


def test_merge_replaces_placeholder_rows_in_order():
    embeds = torch.zeros(6, 3)
    is_mm = torch.tensor([False, True, True, False, True, False])
    images = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    merged = merge_multimodal_embeddings(embeds, images, is_mm)
    assert torch.equal(merged[is_mm], images) and torch.equal(merged[~is_mm], embeds[~is_mm])
    with pytest.raises(ValueError, match="placeholder tokens"):
        merge_multimodal_embeddings(embeds, images[:2], is_mm)
