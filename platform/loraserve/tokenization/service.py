"""Tokenize and detokenize with the served model's tokenizer (adapters share it: none changes the vocabulary).

A `model` is optional, as in vLLM; when given it must name the base model or one of the caller's adapters or
routes, so a tenant learns nothing about names that are not its own (404, as for completions).
"""

from __future__ import annotations

import asyncio
from typing import Any

from loraserve.errors import BadRequest
from loraserve.inference.prompts import render_chat, tokenizer_ids
from loraserve.inference.tools.rendering import template_tools
from loraserve.resolution import ModelNotFound
from loraserve.resolution.resolve import model_exists
from loraserve.services import Services
from loraserve.tenancy import Principal
from loraserve.tokenization.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)


async def tokenize(services: Services, principal: Principal, body: TokenizeRequest) -> TokenizeResponse:
    await _check_model(services, principal, body.model)
    tokenizer = _tokenizer(services)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give either prompt or messages", param="prompt")
    if body.messages is not None:
        text = render_chat(
            body.messages,
            tokenizer,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=template_tools(body.tools) if body.tools else None,
        )
        add_special = bool(body.add_special_tokens)
    else:
        text, add_special = body.prompt, body.add_special_tokens is not False
    ids = await asyncio.to_thread(tokenizer_ids, text, tokenizer, add_special_tokens=add_special)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=services.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(services: Services, principal: Principal, body: DetokenizeRequest) -> DetokenizeResponse:
    await _check_model(services, principal, body.model)
    tokenizer = _tokenizer(services)
    vocab = len(tokenizer)
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))


def tokenizer_info(services: Services) -> TokenizerInfo:
    tokenizer = _tokenizer(services)
    limit = getattr(tokenizer, "model_max_length", None)
    return TokenizerInfo(
        tokenizer_class=type(tokenizer).__name__,
        vocab_size=len(tokenizer),
        # transformers' "no limit" is a huge sentinel; vLLM reports the model's context instead
        model_max_length=limit if isinstance(limit, int) and limit < 1 << 40 else None,
        max_model_len=services.max_model_len,
        bos_token=_text(tokenizer.bos_token),
        eos_token=_text(tokenizer.eos_token),
        pad_token=_text(tokenizer.pad_token),
        unk_token=_text(tokenizer.unk_token),
        add_bos_token=getattr(tokenizer, "add_bos_token", None),
        chat_template=getattr(tokenizer, "chat_template", None) or None,
    )


async def _check_model(services: Services, principal: Principal, model: str | None) -> None:
    if model is not None and not await model_exists(services, principal, model):
        raise ModelNotFound(
            f"the model {model!r} does not exist; use {services.base_model_id!r}, one of your adapters "
            "or one of your routes (GET /v1/models lists them)"
        )


def _tokenizer(services: Services) -> Any:
    if services.tokenizer is None:
        raise BadRequest("this model has no tokenizer", code="no_tokenizer")
    return services.tokenizer


def _text(token: Any) -> str | None:
    return None if token is None else str(token)
