"""``LLM``: the offline API (generate, chat) on top of an engine core."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from enginecore.config import EngineArgs
from enginecore.client.core_client import EngineCoreClient
from enginecore.model.tokenizer import Tokenizer
from enginecore.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    finish_reason_str,
)
from enginecore.protocol import EngineCoreOutput, EngineCoreRequest, PoolingParams
from enginecore.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]
Message = dict[str, str]


class LLM:
    """Generate text from prompts with one engine.

    ``model=None`` loads the default model (SmolLM2-135M-Instruct, fetched once).
    The engine runs in its own process by default (``multiprocess_mode=False``
    keeps it in this one); a script that uses the default must guard its entry
    point with ``if __name__ == "__main__":`` (the engine process is spawned).
    Other keyword arguments are ``EngineArgs`` fields.
    """

    def __init__(
        self, model: str | None = None, *, multiprocess_mode: bool = True, **kwargs: Any
    ) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        if self.config.model_config.is_synthetic:
            raise ValueError("LLM needs a real model; the synthetic model has no tokenizer")
        self.tokenizer = Tokenizer.from_dir(self.config.model_config.model_path)
        self.client = EngineCoreClient.make_client(multiprocess_mode, False, self.config)
        self.supported_tasks: tuple[str, ...] = (self.config.model_config.task,)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # -- requests ------------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(
            "a prompt is a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
            f"got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, sp in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            rid = str(next(self._ids))
            order.append(rid)
            results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(0, "", [])])
            self.client.add_request(EngineCoreRequest(rid, ids, sp))
        self._run(results, use_tqdm and len(prompts) > 1)
        for out in results.values():
            comp = out.outputs[0]
            comp.text = self.tokenizer.decode(comp.token_ids)
            if comp.logprobs:
                for pos in comp.logprobs:
                    for tid, lp in pos.items():
                        lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
        return [results[r] for r in order]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Pooled vectors of the prompts (an embedding model, e.g. all-MiniLM-L6-v2)."""
        if "embed" not in self.supported_tasks:
            raise ValueError(f"{self.config.model_config.model} does not embed; it supports "
                             f"{self.supported_tasks}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        pp = pooling_params or PoolingParams()
        results: dict[str, EmbeddingRequestOutput] = {}
        order = []
        for prompt in prompts:
            text, ids = self._prompt_ids(prompt)
            rid = str(next(self._ids))
            order.append(rid)
            results[rid] = EmbeddingRequestOutput(rid, text, ids)
            self.client.add_request(EngineCoreRequest(rid, ids, pooling_params=pp))
        self._run(results, use_tqdm and len(order) > 1)
        failed = [r for r in results.values() if r.outputs is None]
        if failed:
            raise RuntimeError(f"{len(failed)} embedding requests failed: "
                               f"{getattr(failed[0], 'error', 'see the engine log')}")
        return [results[r] for r in order]

    def _run(self, results: dict[str, Any], progress: bool) -> None:
        from tqdm import tqdm

        pending = sum(1 for r in results.values() if not r.finished)
        bar = tqdm(total=pending, desc="generating", unit="req", disable=not progress)
        total_tokens = 0
        with bar:
            while pending:
                for o in self.client.get_output().outputs:
                    req = results.get(o.request_id)
                    if req is None:
                        continue
                    total_tokens += len(o.new_token_ids)
                    if self._apply(req, o):
                        pending -= 1
                        bar.update(1)
                        bar.set_postfix(tokens=total_tokens)

    @staticmethod
    def _apply(req: Any, o: EngineCoreOutput) -> bool:
        if isinstance(req, EmbeddingRequestOutput):
            if o.pooling_output is not None:
                req.outputs = EmbeddingOutput(o.pooling_output)
            elif o.stop_reason is not None:
                req.error = o.stop_reason  # type: ignore[attr-defined]
            req.finished = o.finish_reason is not None
            return req.finished
        comp = req.outputs[0]
        comp.token_ids.extend(o.new_token_ids)
        if o.new_logprobs is not None:
            lps = comp.logprobs if comp.logprobs is not None else []
            comp.logprobs = lps
            for ids, vals, rank in zip(o.new_logprobs.token_ids, o.new_logprobs.logprobs,
                                       o.new_logprobs.ranks):
                entry = {ids[0]: Logprob(vals[0], rank)}
                for r, (tid, val) in enumerate(zip(ids[1:], vals[1:]), start=1):
                    entry.setdefault(tid, Logprob(val, r))
                lps.append(entry)
            comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + sum(
                v[0] for v in o.new_logprobs.logprobs)
        if o.finish_reason is not None:
            comp.finish_reason = finish_reason_str(o.finish_reason)
            comp.stop_reason = o.stop_reason
            req.finished = True
            req.num_cached_tokens = o.num_cached_tokens
            return True
        return False

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=True)
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text,
                                                                      add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
