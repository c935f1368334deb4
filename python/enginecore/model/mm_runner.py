"""The model runner's multimodal half: the encoder cache's tensors, the vision
encoder runs the scheduler asks for, and each step's input embeddings and
M-RoPE positions.

The scheduler's EncoderCacheManager (sched/encoder_cache_manager.py) decides;
this side holds what it decided: ``encoder_cache[identifier]`` is one item's
``[placeholder tokens, hidden]`` embeddings, written when the scheduler lists
the item in ``scheduled_encoder_inputs`` and dropped when it lists the
identifier in ``free_encoder_mm_hashes``. A step's chunk ``[c, c + n)`` of a
request takes, for each item whose placeholder range it overlaps, the rows of
the overlap, so a chunk may start or end inside a range (the scheduler made
sure the item's output is here).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from enginecore.model.mrope import mrope_chunk_positions
from enginecore.multimodal.inputs import MultiModalFeatureSpec, tensor_from_wire
from enginecore.sched.output import SchedulerOutput


def item_tensors(feature: MultiModalFeatureSpec) -> dict[str, torch.Tensor]:
    """The processed tensors of one item, from their wire bytes."""
    if feature.data is None:
        raise ValueError(f"multimodal item {feature.identifier!r} reached the runner without "
                         "its tensors and is not in the encoder cache")
    return {name: tensor_from_wire(t) for name, t in feature.data.items()}


class MultiModalRunner:
    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        # req id -> (prompt positions [3, L], rope delta): M-RoPE requests with items
        self.mrope: dict[str, tuple[np.ndarray, int]] = {}
        self.num_encoded = 0  # items encoded, ever (benchmarks, tests)

    # -- requests -----------------------------------------------------------------------
    def add_request(self, req_id: str, num_prompt: int,
                    features: list[MultiModalFeatureSpec] | None) -> None:
        if self.uses_mrope and features:
            self.mrope[req_id] = self.model.get_mrope_input_positions(
                num_prompt, [(f.mm_position.offset, _grid_of(f)) for f in features])

    def remove_request(self, req_id: str) -> None:
        self.mrope.pop(req_id, None)

    # -- the encoder ------------------------------------------------------------------------
    def execute_encoders(self, so: SchedulerOutput, states: dict[str, Any]) -> None:
        """Drop what the scheduler evicted; encode what it scheduled."""
        for identifier in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        for rid, indices in so.scheduled_encoder_inputs.items():
            features = states[rid].mm_features
            for i in indices:
                feature = features[i]
                if feature.identifier in self.encoder_cache:
                    continue  # the same image twice in one step
                out = self.model.get_multimodal_embeddings(feature.modality,
                                                           **item_tensors(feature))
                emb = out[0]
                if emb.shape[0] != feature.mm_position.length:
                    raise ValueError(
                        f"multimodal item {feature.identifier!r}: the encoder gave "
                        f"{emb.shape[0]} embeddings for {feature.mm_position.length} "
                        "placeholder tokens")
                self.encoder_cache[feature.identifier] = emb
                self.num_encoded += 1

    # -- one step's inputs -----------------------------------------------------------------
    def step_inputs(self, so: SchedulerOutput, computed: dict[str, int], states: dict[str, Any],
                    input_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(input embeddings [T, hidden] or None, M-RoPE positions [3, T] or None)
        for the flattened step ``_prepare`` built (rows in num_scheduled_tokens order)."""
        pieces: list[torch.Tensor] = []
        flat_rows: list[np.ndarray] = []
        any_mrope = self.uses_mrope and any(rid in self.mrope for rid in so.num_scheduled_tokens)
        positions: list[np.ndarray] = []
        start = 0
        for rid, n in so.num_scheduled_tokens.items():
            st = states[rid]
            c = computed[rid]
            for feature in st.mm_features or ():
                off, length = feature.mm_position.offset, feature.mm_position.length
                lo, hi = max(c, off), min(c + n, off + length)
                if lo >= hi:
                    continue
                emb = self.encoder_cache.get(feature.identifier)
                if emb is None:
                    raise RuntimeError(f"encoder output of {feature.identifier!r} is not cached "
                                       f"for request {rid!r}")
                pieces.append(emb[lo - off:hi - off])
                flat_rows.append(np.arange(start + lo - c, start + hi - c))
            if any_mrope:
                mr = self.mrope.get(rid)
                positions.append(mrope_chunk_positions(mr[0], mr[1], c, c + n) if mr is not None
                                 else np.broadcast_to(np.arange(c, c + n), (3, n)))
            start += n
        embeds = None
        if pieces:
            mask = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            mask[torch.from_numpy(np.concatenate(flat_rows)).to(input_ids.device)] = True
            embeds = self.model.embed_input_ids(input_ids, torch.cat(pieces), mask)
        pos = None
        if positions:
            pos = torch.from_numpy(np.ascontiguousarray(np.concatenate(positions, axis=1))).to(
                device=input_ids.device, dtype=torch.long)
        return embeds, pos


def _grid_of(feature: MultiModalFeatureSpec) -> list[int]:
    """An item's (t, h, w) patch grid (Qwen2-VL's ``image_grid_thw``)."""
    data = feature.data or {}
    grid = data.get("image_grid_thw")
    if grid is None:
        raise ValueError(f"multimodal item {feature.identifier!r} lacks image_grid_thw")
    return [int(v) for v in tensor_from_wire(grid).reshape(-1).tolist()]
