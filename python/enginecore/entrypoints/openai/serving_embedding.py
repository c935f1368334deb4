"""/v1/embeddings (embedding models, e.g. all-MiniLM-L6-v2) and /tokenize,
/detokenize (vLLM's shapes)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from enginecore.entrypoints.openai.errors import APIError, bad_request
from enginecore.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    TokenizeRequest,
    TokenizeResponse,
    now,
)
from enginecore.entrypoints.openai.request_limits import messages_size, prepare_prompts
from enginecore.entrypoints.openai.serving_chat import render_chat
from enginecore.entrypoints.openai.serving_completion import parse_prompts
from enginecore.entrypoints.openai.serving_engine import (
    OpenAIServing,
    answer,
    collect_final,
)
from enginecore.protocol import PoolingParams

_encode = msgspec.json.Encoder().encode


def _json(body: Any) -> Response:
    return Response(_encode(body), media_type="application/json")


def embedding_of(out: Any) -> list[float]:
    """The vector of a finished pooling output (or the engine's reason for none)."""
    result = out.outputs
    vector = getattr(result, "embedding", None)
    if vector is None:
        vector = getattr(result, "data", None)
    if vector is None:
        reason = getattr(out, "error", None) or "the engine returned no embedding"
        raise APIError(400, str(reason))
    return list(vector) if not isinstance(vector, list) else vector


class OpenAIServingEmbedding(OpenAIServing):
    request_prefix = "embd"

    async def create(self, req: EmbeddingRequest, request: Request) -> Response:
        model_name, lora = self.models.resolve(req.model)
        if lora is not None:
            raise bad_request("embeddings do not take LoRA adapters", "model")
        prompts = parse_prompts(req.input)
        request_id = self.new_request_id()
        params = PoolingParams(normalize=req.normalize)
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        ticket = self.ctx.admission.admit(ids, len(prompts))
        try:
            engine_prompts = await prepare_prompts(self, prompts, req.add_special_tokens,
                                                   None, "input")

            async def run_all() -> list[Any]:
                return await asyncio.gather(*(
                    collect_final(self.engine.encode(ep, params, rid))
                    for ep, rid in zip(engine_prompts, ids)))
            finals = await answer(request, run_all())
        finally:
            ticket.release()
        data = []
        tokens = 0
        for i, out in enumerate(finals):
            vector = embedding_of(out)
            if req.dimensions is not None and req.dimensions != len(vector):
                raise bad_request(f"dimensions={req.dimensions}: this model embeds in "
                                  f"{len(vector)} dimensions and cannot truncate", "dimensions")
            tokens += len(out.prompt_token_ids)
            if req.encoding_format == "base64":
                raw = np.asarray(vector, dtype="<f4").tobytes()
                data.append(EmbeddingData(i, base64.b64encode(raw).decode("ascii")))
            else:
                data.append(EmbeddingData(i, vector))
        return _json(EmbeddingResponse(id=request_id, created=now(), model=model_name,
                                       data=data, usage=EmbeddingUsage(tokens, tokens)))


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, req: TokenizeRequest) -> Response:
        self.models.resolve(req.model)
        tok = self.require_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            self.ctx.limits.check_text(messages_size(req.messages), "the messages' text",
                                       "messages")
        else:
            self.ctx.limits.check_text(len(req.prompt), "the prompt text", "prompt")
        if req.messages is not None:
            prompt = render_chat(self.engine.input_processor, req.messages,
                                 add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message,
                                 tools=req.tools,
                                 chat_template_kwargs=req.chat_template_kwargs)
            ids = (tok.encode(prompt["prompt"]) if req.add_special_tokens
                   else prompt["prompt_token_ids"])
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tok.encode(req.prompt, add_special_tokens=add)
        strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
        return _json(TokenizeResponse(len(ids), self.ctx.max_model_len, ids, strs))

    def detokenize(self, req: DetokenizeRequest) -> Response:
        self.models.resolve(req.model)
        tok = self.require_tokenizer()
        vocab = tok.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})",
                              "tokens")
        return _json(DetokenizeResponse(tok.decode(req.tokens)))
