"""``LLM``: the offline API (generate, chat, embed) on the front-end's processors.

Prompts go through the same ``InputProcessor`` as ``AsyncLLM`` (so the same
validation errors), outputs through the same ``OutputProcessor`` (so the same
text, stop strings, ``n`` and logprobs); ``LLM`` asks for FINAL_ONLY outputs and
returns them in prompt order.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from enginecore.client.factory import make_client
from enginecore.config import EngineArgs
from enginecore.frontend.async_llm import load_tokenizer
from enginecore.frontend.input_processor import InputProcessor, PromptType
from enginecore.frontend.metrics import FrontendMetrics, IterationStats
from enginecore.frontend.output_processor import OutputProcessor
from enginecore.frontend.parallel_sampling import ParentRequest
from enginecore.model.tokenizer import Tokenizer
from enginecore.outputs import EmbeddingRequestOutput, RequestMetrics, RequestOutput
from enginecore.protocol import EngineCoreRequest, LoRARequest, PoolingParams
from enginecore.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class LLM:
    """Generate text from prompts with one engine.

    ``model=None`` loads the default model (SmolLM2-135M-Instruct, fetched once).
    The engine runs in its own process by default (``multiprocess_mode=False``
    keeps it in this one); a script that uses the default must guard its entry
    point with ``if __name__ == "__main__":`` (the engine process is spawned).
    ``disable_log_stats=False`` turns on the metrics ``get_metrics()`` reads.
    Other keyword arguments are ``EngineArgs`` fields.
    """

    def __init__(self, model: str | None = None, *, multiprocess_mode: bool = True,
                 disable_log_stats: bool = True, **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        if self.config.model_config.is_synthetic:
            raise ValueError("LLM needs a real model; the synthetic model has no tokenizer")
        self.tokenizer = load_tokenizer(self.config)
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model_config.model} has no tokenizer.json")
        self.log_stats = not disable_log_stats
        self.client = make_client(multiprocess_mode, False, self.config,
                                  log_stats=self.log_stats)
        max_model_len = getattr(self.client, "max_model_len", None)
        if max_model_len is None:  # in process: the engine's (it may have capped it)
            max_model_len = self.client.engine.scheduler.max_model_len
        self.input_processor = InputProcessor(self.config, self.tokenizer, max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, self.log_stats)
        self.metrics = FrontendMetrics(self.config.model_config.model) if self.log_stats else None
        self.supported_tasks: tuple[str, ...] = self.input_processor.supported_tasks
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_metrics(self) -> list[Any]:
        """The enginecore prometheus metric families (needs disable_log_stats=False)."""
        if self.metrics is None:
            raise RuntimeError("metrics are off: make the LLM with disable_log_stats=False")
        return self.metrics.collect()

    # -- requests ------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        final = [msgspec.structs.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                 if isinstance(sp, SamplingParams) else sp for sp in params]
        return self._run_all(prompts, final, use_tqdm, lora_request)  # type: ignore[return-value]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Pooled vectors of the prompts (an embedding model, e.g. all-MiniLM-L6-v2)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        pp = pooling_params or PoolingParams()
        results = self._run_all(prompts, [pp] * len(prompts), use_tqdm, None)
        failed = [r for r in results if r.outputs is None]
        if failed:
            raise RuntimeError(f"{len(failed)} embedding requests failed: "
                               f"{failed[0].error or 'see the engine log'}")
        return results  # type: ignore[return-value]

    encode = embed

    def _run_all(self, prompts: list[PromptType], params: list[Any], use_tqdm: bool,
                 lora_request: LoRARequest | None) -> list[Any]:
        # Everything is validated before anything is sent: one bad prompt sends nothing.
        prepared = []
        for prompt, p in zip(prompts, params):
            rid = str(next(self._ids))
            prepared.append((rid, *self.input_processor.process_inputs(
                rid, prompt, p, lora_request=lora_request)))
        order = []
        try:
            for rid, text, request in prepared:
                order.append(rid)
                self._add(rid, text, request)
            return self._collect(order, use_tqdm and len(order) > 1)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: nothing stays running in the engine.
            live = self.output_processor.engine_ids(order)
            self.output_processor.discard(live)
            if live:
                try:
                    self.client.abort_requests(live)
                except Exception as e:  # noqa: BLE001
                    logger.warning("could not abort %d requests: %s", len(live), e)
            raise

    def _add(self, rid: str, text: str | None, request: EngineCoreRequest) -> None:
        metrics = RequestMetrics(request.arrival_time, time.monotonic())
        sp = request.sampling_params
        if sp is None or sp.n == 1:
            self.output_processor.add_request(request, text, metrics=metrics)
            self.client.add_request(request)
            return
        parent = ParentRequest(rid, sp, text, request.prompt_token_ids, None, metrics,
                               request.lora_request)
        for i, child_id in enumerate(parent.child_ids):
            child = msgspec.structs.replace(request, request_id=child_id,
                                            sampling_params=ParentRequest.child_params(sp, i))
            self.output_processor.add_request(
                child, text, external_id=rid, parent=parent, index=i,
                metrics=RequestMetrics(request.arrival_time, metrics.arrival_ts))
            self.client.add_request(child)

    def _collect(self, order: list[str], progress: bool) -> list[Any]:
        from tqdm import tqdm

        results: dict[str, Any] = {}
        processor = self.output_processor
        with tqdm(total=len(order), desc="generating", unit="req", disable=not progress) as bar:
            while processor.has_unfinished_requests():
                outs = self.client.get_output()
                iteration = IterationStats() if self.metrics is not None else None
                step = processor.process_outputs(outs.outputs, None, iteration)
                if step.reqs_to_abort:
                    self.client.abort_requests(step.reqs_to_abort)
                if self.metrics is not None:
                    self.metrics.record(iteration, outs.scheduler_stats, outs.engine_index)
                for out in step.request_outputs:
                    results[out.request_id] = out
                    bar.update(1)
        return [results[rid] for rid in order]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            self.input_processor.render_chat(
                list(conv), add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools,
                documents=documents, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs)
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
