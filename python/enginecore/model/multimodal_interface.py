"""What a vision-language model gives the runner (vLLM's SupportsMultiModal shape).

The runner, for each request with ``mm_features``, runs the encoder on the items
the scheduler picked (``get_multimodal_embeddings``), keeps the outputs in the
encoder cache by identifier, and for every step builds the input embeddings with
``embed_input_ids``: the text embeddings with the rows where ``is_multimodal``
is True replaced, in order, by the slices of the items' embeddings that the step
covers. Models that position tokens themselves (Qwen2-VL's M-RoPE: 3 rows of
positions) set ``uses_mrope`` and return the prompt's positions from
``get_mrope_input_positions``; decode positions continue from
``mrope_position_delta``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from enginecore.multimodal.inputs import MultiModalFeatureSpec


@runtime_checkable
class SupportsMultiModal(Protocol):
    """A causal LM that takes image embeddings at its placeholder tokens."""

    supports_multimodal: bool  # True; a class attribute the runner checks
    uses_mrope: bool  # True when positions are 3 rows (temporal, height, width)

    def get_placeholder_token_id(self, modality: str) -> int:
        """The token id the processor expands one item of ``modality`` into."""
        ...

    def get_multimodal_embeddings(self, modality: str,
                                  **tensors: torch.Tensor) -> list[torch.Tensor]:
        """One ``[num_placeholder_tokens, hidden_size]`` tensor per item of a batch of
        processed items of one modality (``tensors``: the processor's outputs, e.g.
        ``pixel_values``, stacked as the HF model's forward takes them)."""
        ...

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: torch.Tensor | None = None,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[num_tokens, hidden]`` input embeddings: the token embeddings of
        ``input_ids``, with the rows where ``is_multimodal`` (bool, one per token)
        replaced in order by the rows of ``multimodal_embeddings``
        (``[is_multimodal.sum(), hidden]``)."""
        ...

    def get_mrope_input_positions(
        self, prompt_token_ids: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        """M-RoPE models only: ``[3, len(prompt)]`` positions and the delta that
        decode positions add to the token index (vLLM's mrope_position_delta)."""
        ...


def supports_multimodal(model: object) -> bool:
    """Whether ``model`` takes multimodal inputs."""
    return bool(getattr(model, "supports_multimodal", False))


def merge_multimodal_embeddings(
    inputs_embeds: torch.Tensor, multimodal_embeddings: torch.Tensor, is_multimodal: torch.Tensor
) -> torch.Tensor:
    """``inputs_embeds`` with its ``is_multimodal`` rows replaced, in order, by
    ``multimodal_embeddings``; the one merge every model's embed_input_ids uses."""
    expected = int(is_multimodal.sum())
    if multimodal_embeddings.shape[0] != expected:
        raise ValueError(
            f"{multimodal_embeddings.shape[0]} multimodal embedding rows for {expected} "
            "placeholder tokens"
        )
    merged = inputs_embeds.clone()
    merged[is_multimodal] = multimodal_embeddings.to(merged.dtype)
    return merged
