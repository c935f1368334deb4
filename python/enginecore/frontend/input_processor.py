"""Input processing: prompts -> ``EngineCoreRequest``s, validated here.

Everything the engine would refuse is refused here first, with a ``ValueError``
(bad values) or ``TypeError`` (bad types) that names the problem, so a bad
request fails at the caller (the server answers 400) and never travels to the
engine: prompt types and token ids (in the model's vocabulary), an empty prompt,
prompt length against ``max_model_len`` (and ``max_num_batched_tokens`` for
pooling), ``max_tokens`` against the room left (``None`` is resolved to that
room), stop strings without a tokenizer, stop token ids, structured-output
constraints that do not compile, LoRA (enabled, adapter config), the task
(generate vs embed), priority without priority scheduling, the data-parallel
rank, seeds of ``n`` children, and the token-id fields (``logit_bias`` keys,
``allowed_token_ids``, ``bad_words`` once tokenized) against the vocabulary.
``truncate_prompt_tokens`` keeps the prompt's last k tokens here (-1: the
maximum model length); ``bad_words`` become ``bad_words_token_ids`` here (vLLM:
each word with and without a leading space); every request carries the
tokenizer's EOS as its ``eos_token_id``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from enginecore.config import EngineConfig
from enginecore.kv_transfer.transfer_params import check_kv_transfer_params
from enginecore.multimodal.cache import MultiModalSenderCache, cache_capacity_bytes
from enginecore.multimodal.chat_parts import extract_images, has_image_parts
from enginecore.multimodal.processing import MultiModalProcessor, check_no_images
from enginecore.protocol import EngineCoreRequest, LoRARequest, PoolingParams
from enginecore.sampling_params import _MAX_SEED, SamplingParams
from enginecore.sched.request_queue import SchedulingPolicy

PromptType = str | dict[str, Any]
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "lora_request",
                          "multi_modal_data"})


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any | None,
                 max_model_len: int | None = None) -> None:
        mc, sc, pc = config.model_config, config.scheduler_config, config.parallel_config
        self.config = config
        self.tokenizer = tokenizer
        # The engine's (it may have capped max_model_len to its KV cache).
        self.max_model_len = max_model_len or sc.max_model_len
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.vocab_size = mc.vocab_size
        self.supported_tasks = (mc.task,)
        self.priority_scheduling = sc.scheduling_policy == SchedulingPolicy.PRIORITY
        self.dp_size = 1 if pc.data_parallel_external_lb else pc.data_parallel_size
        self.lora_config = config.lora_config
        # LoRA paths are checked here only when every engine runs on this machine.
        self._engines_local = (pc.data_parallel_size_local >= pc.data_parallel_size
                               and pc.data_parallel_backend != "ray")
        self._structured: Any = None
        self._checked_constraints: dict[tuple[str, str], None] = {}  # recent, bounded
        self._arch: Any = None  # the model's LlamaArchConfig, for LoRA checks
        # Images: the model's HF image processor (None: a text-only model).
        self.mm_processor = MultiModalProcessor.create(
            mc.model_path or mc.model, config.multimodal_config)
        # Which items the engine holds (one engine only: with data parallel each
        # engine would need its own, so every item carries its data).
        capacity = cache_capacity_bytes(config.multimodal_config.mm_processor_cache_gb)
        self.mm_sender_cache = (MultiModalSenderCache(capacity)
                                if self.mm_processor is not None and capacity > 0
                                and pc.data_parallel_size == 1 else None)

    # -- prompts ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of a prompt: a str, {"prompt": str} or
        {"prompt_token_ids": [int, ...]} (optionally with "prompt" text and "cache_salt")."""
        salt = None
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = None
        elif isinstance(prompt, dict):
            unknown = set(prompt) - _PROMPT_KEYS
            if unknown:
                raise ValueError(f"unknown prompt fields {sorted(unknown)}; a prompt dict has "
                                 f"{sorted(_PROMPT_KEYS)}")
            text, ids, salt = prompt.get("prompt"), prompt.get("prompt_token_ids"), \
                prompt.get("cache_salt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"prompt must be a str, got {type(text).__name__}")
            if ids is None and text is None:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        else:
            raise TypeError("a prompt is a str, {'prompt': str} or {'prompt_token_ids': "
                            f"[int, ...]}}, got {type(prompt).__name__}")
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt_token_ids")
            ids = self.tokenizer.encode(text)
        else:
            ids = self._check_token_ids(ids, "prompt_token_ids")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        return text, ids, salt

    def _check_token_ids(self, ids: Any, what: str) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{what} must be a list of ints, got {type(ids).__name__}")
        vocab = self.vocab_size
        for t in ids:
            if type(t) is not int:
                raise TypeError(f"{what} must be ints, got {type(t).__name__} {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"{what} must be in [0, {vocab}) (the model's vocabulary), "
                                 f"got {t}")
        return list(ids)

    # -- requests --------------------------------------------------------------------------
    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None,
        *,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenize one request; (prompt text, request for the engine).
        Sampling params come back as a validated copy with ``max_tokens`` resolved."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if params is None:
            params = SamplingParams()
        pooling = isinstance(params, PoolingParams)
        if not pooling and not isinstance(params, SamplingParams):
            raise TypeError("params must be SamplingParams (generate) or PoolingParams "
                            f"(encode), got {type(params).__name__}")
        task = "embed" if pooling else "generate"
        if task not in self.supported_tasks:
            raise ValueError(f"this model does not support the {task!r} task; it supports "
                             f"{self.supported_tasks}")
        text, ids, salt = self.tokenize_prompt(prompt)
        ids, mm_features = self._process_mm(prompt, ids)
        lora_request = self._prompt_lora(prompt, lora_request)
        if not pooling and params.truncate_prompt_tokens is not None:
            ids = self._truncate(ids, params.truncate_prompt_tokens)
        salt = cache_salt if cache_salt is not None else salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty str, got {salt!r}")
        self._check_priority(priority)
        self._check_dp_rank(data_parallel_rank)
        if lora_request is not None:
            self._check_lora(lora_request)
        n = len(ids)
        if pooling:
            if n > self.max_model_len:
                raise ValueError(f"the prompt ({n} tokens) is longer than the maximum model "
                                 f"length of {self.max_model_len}")
            if n > self.max_num_batched_tokens:
                raise ValueError(f"an embedding prompt runs in one step: {n} tokens > "
                                 f"max_num_batched_tokens {self.max_num_batched_tokens}")
            sp = None
        else:
            sp = self._check_sampling(params, n)
        request = EngineCoreRequest(
            request_id, ids, sp, time.time() if arrival_time is None else arrival_time,
            lora_request, salt, data_parallel_rank, priority=priority,
            pooling_params=params if pooling else None, eos_token_id=self._eos_token_id(),
            mm_features=mm_features or None, kv_transfer_params=_kv_transfer_params(sp))
        return text, request

    def strip_sent_mm(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """``request`` as it goes on the wire: items the engine holds by identifier
        only. Call it right before handing the request to the engine client."""
        if self.mm_sender_cache is None or not request.mm_features:
            return request
        return msgspec.structs.replace(
            request, mm_features=self.mm_sender_cache.strip_cached(request.mm_features))

    def clear_mm_cache(self) -> None:
        """Forget what the engine holds (a send failed, or reset_mm_cache): items
        are sent with their data again (the engine may hold more, never less)."""
        if self.mm_sender_cache is not None:
            self.mm_sender_cache.clear()

    def _process_mm(self, prompt: PromptType, ids: list[int]) -> tuple[list[int], list[Any]]:
        """The prompt's images processed: placeholders expanded, items to send."""
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if self.mm_processor is None:
            check_no_images(mm_data, self.config.model_config.model)
            return ids, []
        if mm_data is None:
            mm_data = {}
        return self.mm_processor.process(ids, mm_data)

    def _eos_token_id(self) -> int | None:
        """The tokenizer's EOS (vLLM sets it per request); None: the engine's model's."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if isinstance(eos, int) and 0 <= eos < self.vocab_size else None

    @staticmethod
    def _prompt_lora(prompt: PromptType, lora_request: LoRARequest | None
                     ) -> LoRARequest | None:
        """The adapter of a prompt dict's "lora_request" (it must agree with the
        ``lora_request`` argument when both are given)."""
        if not isinstance(prompt, dict) or prompt.get("lora_request") is None:
            return lora_request
        own = prompt["lora_request"]
        if lora_request is not None and own != lora_request:
            raise ValueError(f"the prompt's lora_request {own!r} differs from the "
                             f"lora_request argument {lora_request!r}")
        return own

    def _truncate(self, ids: list[int], k: int) -> list[int]:
        """The last ``k`` prompt tokens (vLLM: -1 is max_model_len; more is an error)."""
        if k == -1:
            k = self.max_model_len
        elif k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) is greater than the maximum model "
                             f"length ({self.max_model_len}); choose a smaller truncation size")
        return ids[-k:]

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word without, then with a leading
        space (the second only when it tokenizes to a different first token and the
        same number of tokens, i.e. the space made a new word token)."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this engine has none")
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if plain:
                out.append(plain)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        if not out:
            raise ValueError(f"bad_words {words!r} tokenize to nothing")
        return out

    def _check_sampling(self, params: SamplingParams, n: int) -> SamplingParams:
        room = self.max_model_len - n
        if room < 1:
            raise ValueError(f"the prompt ({n} tokens) leaves no room to generate within the "
                             f"maximum model length of {self.max_model_len}")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {n + max_tokens} ({n} in the prompt, {max_tokens} to "
                "generate): reduce the prompt or max_tokens")
        # A validated copy: the caller's object is left alone (and re-checked, in case it
        # was changed after construction).
        sp = msgspec.structs.replace(params, max_tokens=max_tokens)
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        self._check_token_ids(sp.stop_token_ids, "stop_token_ids")
        if sp.logit_bias:
            self._check_token_ids(list(sp.logit_bias), "logit_bias keys")
        if sp.allowed_token_ids is not None:
            self._check_token_ids(sp.allowed_token_ids, "allowed_token_ids")
        if sp.bad_words:
            sp.bad_words_token_ids = self.bad_words_token_ids(sp.bad_words)
            for word in sp.bad_words_token_ids:
                self._check_token_ids(word, "bad_words tokens")
        elif sp.bad_words_token_ids is not None:
            for word in sp.bad_words_token_ids:
                self._check_token_ids(word, "bad_words_token_ids")
        if sp.seed is not None and sp.seed + sp.n - 1 > _MAX_SEED:
            raise ValueError(f"seed {sp.seed} + n - 1 does not fit in 64 bits (child "
                             "requests use seed + index)")
        if sp.structured_outputs is not None:
            self._check_structured(sp)
        return sp

    def _check_structured(self, sp: SamplingParams) -> None:
        from enginecore.sched.structured_output import (
            StructuredOutputError,
            StructuredOutputManager,
        )

        if self._structured is None:
            mc = self.config.model_config
            path = mc.model_path and os.path.join(mc.model_path, "tokenizer.json")
            self._structured = StructuredOutputManager(
                path if path and os.path.exists(path) else None, mc.vocab_size,
                mc.eos_token_id)
        key = sp.structured_outputs.key()
        if key in self._checked_constraints:
            return  # compiled a moment ago (the API server does it off its event loop)
        try:
            self._structured.compile(sp.structured_outputs)
        except StructuredOutputError as e:
            raise ValueError(str(e)) from None
        if len(self._checked_constraints) >= _CHECKED_CONSTRAINTS:
            self._checked_constraints.pop(next(iter(self._checked_constraints)), None)
        self._checked_constraints[key] = None

    def check_structured(self, sp: SamplingParams) -> None:
        """Compile ``sp``'s constraint (ValueError if it does not): callable from a
        worker thread, so the later check of the same request is a lookup."""
        if sp.structured_outputs is not None:
            self._check_structured(sp)

    def _check_priority(self, priority: Any) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if priority != 0 and not self.priority_scheduling:
            raise ValueError(f"priority {priority} needs scheduling_policy='priority'")

    def _check_dp_rank(self, rank: Any) -> None:
        if rank is None:
            return
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.dp_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.dp_size}), got {rank!r}")

    def _check_lora(self, lora: Any) -> None:
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if not self.lora_config.enable_lora:
            raise ValueError("LoRA is not enabled on this engine (enable_lora=True)")
        if not isinstance(lora.lora_int_id, int) or lora.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {lora.lora_int_id!r}")
        if not lora.lora_name:
            raise ValueError("lora_name must not be empty")
        if lora.lora_path and self._engines_local:
            from enginecore.model.arch_config import load_arch_config
            from enginecore.model.lora import LoRAError, read_adapter_config

            try:
                if self._arch is None:
                    self._arch = load_arch_config(self.config.model_config.model_path)
                read_adapter_config(lora.lora_path, lora.lora_int_id, lora.lora_name,
                                    self.lora_config.max_lora_rank, self._arch)
            except LoRAError as e:
                raise ValueError(str(e)) from None
            except (OSError, ValueError) as e:
                raise ValueError(f"LoRA {lora.lora_name!r}: unreadable adapter config: {e}"
                                 ) from None

    # -- chat --------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        untrusted_template: bool = False,
        content_format: str | None = None,
    ) -> dict[str, Any]:
        """A conversation as a prompt: {"prompt": text, "prompt_token_ids": ids}
        (the template writes the special tokens, so none are added on top).
        ``untrusted_template``: ``chat_template`` came from a request (strict limits)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: chat needs its chat template")
        images: list[Any] = []
        if has_image_parts(messages):
            if self.mm_processor is None:
                check_no_images({"image": "a chat image part"}, self.config.model_config.model)
            messages, images = extract_images(list(messages), self.mm_processor.limits)
            self.mm_processor.check_count("image", len(images))
        text = self.tokenizer.apply_chat_template(
            normalize_messages(messages), add_generation_prompt, tools=tools,
            documents=documents, chat_template=chat_template,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, untrusted_template=untrusted_template,
            content_format=content_format)
        prompt = {"prompt": text,
                  "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return prompt

# Constraints compiled recently (by key): a request checked off the event loop is
# not compiled a second time on it.
_CHECKED_CONSTRAINTS = 64

_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI-shaped messages for a template: content given as a list of parts
    ({"type": "text", "text": ...}) becomes one string; other part types are refused."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, given in enumerate(messages):
        msg = given
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a str 'role'")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in ("text", "image"):  # image: from extract_images
                    raise ValueError(f"messages[{i}]: content part {kind!r} is not supported "
                                     "(text, image_url)")
                texts.append(str(part.get("text", "")) if kind == "text" else None)
            # Images stay parts for the template to place; text alone is one string.
            msg = {**msg, "content": (
                "\n".join(texts) if None not in texts else
                [{"type": "image"} if t is None else {"type": "text", "text": t}
                 for t in texts])}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a str or a list of text parts")
        elif content is None and msg["role"] in _CONTENT_REQUIRED:
            # OpenAI's schema: only an assistant turn (tool calls) may omit content.
            raise ValueError(f"messages[{i}]: a {msg['role']!r} message needs 'content'")
        out.append(msg)
    return out


def _kv_transfer_params(params: object) -> dict | None:
    """vLLM's SamplingParams.extra_args["kv_transfer_params"] (the KV connector's)."""
    extra = getattr(params, "extra_args", None)
    value = extra.get("kv_transfer_params") if extra else None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"kv_transfer_params must be a JSON object, got {value!r}")
    if value is not None:
        check_kv_transfer_params(value)
    return value
