"""``n > 1``: one caller request fans out into ``n`` child requests in the engine
and their outputs fan back in (vLLM's ParentRequest semantics).

Child ``i`` is the engine request ``f"{i}_{request_id}"`` with ``n=1`` and, when
the parent has a seed, seed ``seed + i``: the samples differ from each other and
the whole set is reproducible. Each child's ``CompletionOutput.index`` is ``i``.
Per step the children that produced something are merged into one parent
``RequestOutput`` (DELTA / CUMULATIVE); FINAL_ONLY gives one output with all
``n`` completions once every child has finished. The parent is finished when
its last child is.
"""

from __future__ import annotations

import msgspec

from enginecore.outputs import CompletionOutput, RequestMetrics, RequestOutput
from enginecore.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


class ParentRequest:
    __slots__ = ("request_id", "n", "output_kind", "queue", "prompt", "prompt_token_ids",
                 "lora_request", "child_ids", "num_unfinished", "final", "step_outputs",
                 "touched", "metrics", "num_cached_tokens", "prompt_logprobs")

    def __init__(self, request_id: str, params: SamplingParams, prompt: str | None,
                 prompt_token_ids: list[int], queue: object | None,
                 metrics: RequestMetrics, lora_request: object | None = None) -> None:
        self.request_id = request_id
        self.n = params.n
        self.output_kind = int(params.output_kind)
        self.queue = queue
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.lora_request = lora_request
        self.child_ids = [child_request_id(i, request_id) for i in range(self.n)]
        self.num_unfinished = self.n
        # FINAL_ONLY: each child's final completion, by index.
        self.final: list[CompletionOutput | None] = [None] * self.n
        # Completions of this step, merged into one parent output after the step.
        self.step_outputs: list[CompletionOutput] = []
        self.touched = False
        # The parent's timing (arrival of the caller's request; first token of any child).
        self.metrics = metrics
        self.num_cached_tokens = 0
        # prompt_logprobs: computed by child 0 only (the prompt is the same for all).
        self.prompt_logprobs: list | None = None

    @staticmethod
    def child_params(params: SamplingParams, index: int) -> SamplingParams:
        seed = None if params.seed is None else params.seed + index
        prompt_logprobs = params.prompt_logprobs if index == 0 else None
        return msgspec.structs.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def streaming(self) -> bool:
        return self.output_kind != RequestOutputKind.FINAL_ONLY


def emit_parent_outputs(parents: list[ParentRequest], now: float, returned: list) -> None:
    """After a step's loop (both twins): one RequestOutput per parent that had
    news, into its queue or ``returned``. Per parent, not per token: not compiled."""
    for parent in parents:
        parent.touched = False
        finished = parent.num_unfinished == 0
        if parent.output_kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                continue
            comps = list(parent.final)
        else:
            comps = sorted(parent.step_outputs, key=_index)
            parent.step_outputs = []
            if not comps:
                continue
        pm = parent.metrics
        if pm.first_token_ts is None:
            pm.first_token_ts = now
        pm.last_token_ts = now
        if finished:
            pm.finished_ts = now
        plp = parent.prompt_logprobs
        if plp is not None and parent.output_kind == RequestOutputKind.DELTA:
            parent.prompt_logprobs = None  # sent once
        out = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, comps,
                            finished, parent.num_cached_tokens, pm, parent.lora_request, plp)
        if parent.queue is not None:
            parent.queue.put(out)
        else:
            returned.append(out)


def _index(comp: CompletionOutput) -> int:
    return comp.index
