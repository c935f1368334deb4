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
from enginecore.frontend.metrics_reader import Metric, get_metrics_snapshot
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
        self.metrics = (FrontendMetrics(self.config.model_config.model,
                                        spec_decode=self.config.speculative_config.enabled)
                        if self.log_stats else None)
        self.supported_tasks: tuple[str, ...] = self.input_processor.supported_tasks
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The server's metric set, read now, as vLLM's ``vllm.v1.metrics.reader``
        returns it: Counter / Gauge / Histogram / Vector objects with ``name``,
        ``labels`` and their value(s) (needs disable_log_stats=False)."""
        if self.metrics is None:
            raise RuntimeError("metrics are off: make the LLM with disable_log_stats=False")
        return get_metrics_snapshot(self.metrics.registry)

    # -- engine utilities (vLLM's LLM methods) -----------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory: level 1 offloads the weights and drops the KV
        cache, level 2 drops both; ``wake_up()`` restores them."""
        self.client.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` freed; ``tags``: "weights" and/or "kv_cache" (all
        when None)."""
        self.client.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.client.call_utility("is_sleeping")

    def reset_mm_cache(self) -> bool:
        """Forget the processed images on both sides (front-end first)."""
        self.input_processor.clear_mm_cache()
        return self.client.call_utility("reset_mm_cache")

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False while requests hold blocks."""
        return self.client.call_utility("reset_prefix_cache")

    def start_profile(self) -> None:
        """Start the torch profiler in the engine (traces go to profiler_dir)."""
        self.client.call_utility("profile", True)

    def stop_profile(self) -> None:
        self.client.call_utility("profile", False)

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call an allow-listed method on every worker of the engine; their results."""
        return self.client.call_utility("collective_rpc", method, timeout, list(args), kwargs)

    # -- requests ------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; ``sampling_params`` and ``lora_request``
        are one for all prompts or a list with one per prompt (a prompt dict may carry
        its own "lora_request"). Outputs come back in prompt order."""
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
        return self._run_all(prompts, final, use_tqdm,  # type: ignore[return-value]
                             _per_prompt(lora_request, len(prompts), "lora_request"),
                             _per_prompt(priority, len(prompts), "priority", list_only=True))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Pooled vectors of the prompts (an embedding model, e.g. all-MiniLM-L6-v2)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        pp = pooling_params or PoolingParams()
        results = self._run_all(prompts, [pp] * len(prompts), use_tqdm, [None] * len(prompts))
        failed = [r for r in results if r.outputs is None]
        if failed:
            raise RuntimeError(f"{len(failed)} embedding requests failed: "
                               f"{failed[0].error or 'see the engine log'}")
        return results  # type: ignore[return-value]

    encode = embed

    def _run_all(self, prompts: list[PromptType], params: list[Any], use_tqdm: bool,
                 loras: list[LoRARequest | None],
                 priorities: list[int | None] | None = None) -> list[Any]:
        # Everything is validated before anything is sent: one bad prompt sends nothing.
        prepared = []
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
            rid = str(next(self._ids))
            priority = priorities[i] if priorities and priorities[i] is not None else 0
            prepared.append((rid, *self.input_processor.process_inputs(
                rid, prompt, p, lora_request=lora, priority=priority)))
        order = []
        try:
            for rid, text, request in prepared:
                order.append(rid)
                self._add(rid, text, request)
            return self._collect(order, use_tqdm and len(order) > 1)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: nothing stays running in the engine; the
            # aborted requests are counted (finished "abort") like the server's.
            live = self.output_processor.engine_ids(order)
            if self.metrics is not None and live:
                iteration = IterationStats()
                self.output_processor.abort_requests(order, iteration=iteration)
                self.metrics.record(iteration)
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
            self._send(request)
            return
        parent = ParentRequest(rid, sp, text, request.prompt_token_ids, None, metrics,
                               request.lora_request)
        for i, child_id in enumerate(parent.child_ids):
            child = msgspec.structs.replace(request, request_id=child_id,
                                            sampling_params=ParentRequest.child_params(sp, i))
            self.output_processor.add_request(
                child, text, external_id=rid, parent=parent, index=i,
                metrics=RequestMetrics(request.arrival_time, metrics.arrival_ts))
            self._send(child)

    def _send(self, request: EngineCoreRequest) -> None:
        try:
            self.client.add_request(self.input_processor.strip_sent_mm(request))
        except BaseException:
            self.input_processor.clear_mm_cache()  # the engine may not have its items
            raise

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

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling parameters a request gets when it gives none."""
        return SamplingParams()

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate
        (``lora_request``: one for all, or one per conversation). The first five
        parameters are positional in vLLM's order. ``chat_template``: the template,
        or a file holding it (vLLM's ``--chat-template`` rule)."""
        from enginecore.model.chat_templates import load_chat_template

        chat_template = load_chat_template(chat_template)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            self.input_processor.render_chat(
                list(conv), add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools,
                documents=documents, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                content_format=chat_template_content_format)
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(value: Any, n: int, name: str, list_only: bool = False) -> list[Any]:
    """One value for each of ``n`` prompts: a list must have ``n`` entries; a single
    value (not with ``list_only``) is used for all; None: None for all."""
    if value is None:
        return [None] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{len(value)} {name} values for {n} prompts (one per prompt)")
        return list(value)
    if list_only:
        raise TypeError(f"{name} must be a list with one value per prompt, "
                        f"got {type(value).__name__}")
    return [value] * n
