"""Block hashes key every block that a multimodal item's placeholder overlaps by
the item's identifier (vLLM's mm extra keys), identically on both paths: two
different images behind the same placeholder tokens never share a block."""

import hashlib

import pytest

from enginecore.multimodal import MultiModalFeatureSpec, PlaceholderRange
from enginecore.request import Request
from enginecore.sampling_params import SamplingParams
from enginecore.sched.block_hash import (
    ROOT_PARENT,
    encode_extra_keys,
    mm_block_extra_keys,
    tokens_to_bytes,
)
from enginecore.sched.request_table import PyRequestTable

BS = 4
IMAGE = 9  # the placeholder token


def prompt_with_image(n_before=3, n_image=6, n_after=7):
    return [1] * n_before + [IMAGE] * n_image + [2] * n_after


def request(tokens, features, *, cache_salt=None, request_id="r"):
    return Request(request_id, tokens, SamplingParams(max_tokens=8), None, block_size=BS,
                   cache_salt=cache_salt, mm_features=features)


def image(identifier, offset=3, length=6):
    return MultiModalFeatureSpec("image", identifier, PlaceholderRange(offset, length))


def reference_hashes(tokens, items, extra=b""):
    """The documented byte encoding, written out: parent || tokens as uint32 LE ||
    identifiers of the overlapping items (str keys) || request extra keys."""
    out, parent = [], ROOT_PARENT
    for b in range(len(tokens) // BS):
        ids = [i for (off, n, i) in items if off < (b + 1) * BS and b * BS < off + n]
        parent = hashlib.sha256(parent + tokens_to_bytes(tokens[b * BS:(b + 1) * BS])
                                + encode_extra_keys(ids) + extra).digest()
        out.append(parent)
    return out


def test_block_keys_name_every_overlapping_item():
    keys = mm_block_extra_keys([(9, 2, "b"), (3, 6, "a")], BS)
    assert keys == [encode_extra_keys(["a"]), encode_extra_keys(["a"]),
                    encode_extra_keys(["a", "b"])]
    assert mm_block_extra_keys([(4, 4, "a")], BS) == [b"", encode_extra_keys(["a"])]
    assert mm_block_extra_keys([], BS) == []


def test_hashes_follow_the_documented_encoding(hot_path):
    tokens = prompt_with_image()
    req = request(tokens, [image("img-a")], cache_salt="s")
    expected = reference_hashes(tokens, [(3, 6, "img-a")], encode_extra_keys(["s"]))
    assert req.block_hashes == expected
    # Output tokens fill the tail block, which the image does not reach: chained as usual.
    req.table.append_token_ids(req.slot, [5] * 4)
    assert req.block_hashes == reference_hashes(tokens + [5] * 4, [(3, 6, "img-a")],
                                                encode_extra_keys(["s"]))


def test_an_image_in_the_tail_block_keys_it_when_output_fills_it(hot_path):
    tokens = [1] * 5 + [IMAGE] * 2  # the image sits in the partial block 1
    req = request(tokens, [image("img-a", 5, 2)])
    assert len(req.block_hashes) == 1
    req.table.append_token_ids(req.slot, [3, 3])
    assert req.block_hashes == reference_hashes(tokens + [3, 3], [(5, 2, "img-a")])
    other = request(tokens, [image("img-b", 5, 2)], request_id="o")
    other.table.append_token_ids(other.slot, [3, 3])
    assert other.block_hashes[0] == req.block_hashes[0]
    assert other.block_hashes[1] != req.block_hashes[1]


def test_two_images_with_the_same_placeholders_share_only_the_text_before_them(hot_path):
    tokens = prompt_with_image(n_before=5)
    a = request(tokens, [image("img-a", offset=5)])
    b = request(tokens, [image("img-b", offset=5)], request_id="b")
    text = request(tokens, None, request_id="t")
    assert a.block_hashes[0] == b.block_hashes[0] == text.block_hashes[0]  # block 0: text only
    assert all(x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:]))
    assert a.block_hashes[1] != text.block_hashes[1]
    again = request(tokens, [image("img-a", offset=5)], request_id="a2")
    assert again.block_hashes == a.block_hashes


def test_row_state_carries_the_block_keys_across_tables_and_kinds(hot_path):
    tokens = [1] * 5 + [IMAGE] * 2
    req = request(tokens, [image("img-a", 5, 2)])
    req.move_to(PyRequestTable(None, BS))
    req.table.append_token_ids(req.slot, [3, 3])
    assert req.block_hashes == reference_hashes(tokens + [3, 3], [(5, 2, "img-a")])


@pytest.mark.parametrize("bad", [[1], "ab", [b"x", 2]])
def test_block_keys_must_be_bytes(bad):
    from enginecore import _native

    kinds = [PyRequestTable] + ([_native._ext.RequestTable] if _native._ext is not None else [])
    for kind in kinds:
        with pytest.raises(TypeError):
            kind(None, BS).add("r", [1, 2], 0, 8, 0, -1, False, [], 0, 0.0, b"", True, bad)
