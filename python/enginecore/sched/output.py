"""What the scheduler hands the executor each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from enginecore.kv_transfer.output import KVConnectorOutput
from enginecore.multimodal.inputs import MultiModalFeatureSpec
from enginecore.protocol import LoRARequest
from enginecore.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after a preemption).

    ``token_ids`` are all known tokens (prompt, then outputs so far when the
    request resumes from preemption); ``num_prompt_tokens`` splits them.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    eos_token_id: int | None = None
    # Images and their placeholders (multimodal/inputs.py), in prompt order.
    mm_features: list[MultiModalFeatureSpec] | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds: parallel lists, one entry per request."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks added this step (None when none were).
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (prefill chunk, 1 for decode, 1+drafts).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    # Finished since the last step: the runner drops their state.
    finished_req_ids: set[str]
    # Preempted this step: the runner drops their state; they come back as new.
    preempted_req_ids: set[str]
    step_id: int = 0
    # Structured outputs: allowed-token bitmask (int32 words) of each constrained
    # request that samples this step, computed from its grammar state.
    grammar_bitmask: dict[str, Any] = field(default_factory=dict)
    # KV transfer: the scheduler-side connector's metadata for the workers (None
    # without a connector).
    kv_connector_metadata: Any = None
    # Multimodal (vLLM's names): request id -> indices of its mm_features the
    # runner encodes this step (then keeps by identifier); identifiers the
    # encoder cache evicted, for the runner to drop.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens per scheduled request, in ``req_ids`` order.

    A request in the middle of a chunked prefill gets an empty list.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    # Per request: (token_ids rows, logprob rows, sampled ranks) or None.
    logprobs: list[tuple[list[list[int]], list[list[float]], list[int]] | None] | None = None
    num_nans_in_logits: dict[str, int] | None = None
    # Pooling models: the pooled vector of each request that finished this step.
    pooler_output: list[list[float] | None] | None = None
    # prompt_logprobs: req_id -> (token_ids rows, logprob rows, ranks) of the whole
    # prompt, given in the step that samples the request's first token.
    prompt_logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] | None = None
    # KV transfer: the worker-side connector's report of this step (finished sends /
    # receives, load errors, stats); None without a connector.
    kv_connector_output: KVConnectorOutput | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], {}, [])
