"""EngineCoreRequests with images, built from an HF processor's outputs the way
a front-end does: one MultiModalFeatureSpec per image (identifier = sha256 of
its processed tensors, placeholder = the run of image tokens)."""

from __future__ import annotations

import hashlib

import torch

from enginecore import EngineCoreRequest, SamplingParams
from enginecore.multimodal import MultiModalFeatureSpec, PlaceholderRange, tensor_to_wire


def placeholder_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of image tokens."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def mm_request(rid: str, ids: list[int], items: list[dict[str, torch.Tensor]],
               image_token_id: int, max_tokens: int) -> EngineCoreRequest:
    runs = placeholder_runs(ids, image_token_id)
    assert len(runs) == len(items), (runs, len(items))
    features = []
    for (offset, length), item in zip(runs, items):
        data = {name: tensor_to_wire(t) for name, t in sorted(item.items())}
        digest = hashlib.sha256()
        for name, t in data.items():
            digest.update(name.encode() + repr((t.dtype, t.shape)).encode() + t.data)
        features.append(MultiModalFeatureSpec("image", digest.hexdigest(),
                                              PlaceholderRange(offset, length), data))
    return EngineCoreRequest(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True),
                             mm_features=features or None)
