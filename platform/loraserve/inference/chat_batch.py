"""vLLM's `POST /v1/chat/completions/batch`: several conversations, one set of sampling fields, one answer.

`messages` is a list of conversations; each is rendered with the chat template as a chat request's
messages are, and runs as one prompt of the request (all of them batched together in the engine, on the
same model or adapter). The answer is one `chat.completion` whose choice `i` answers conversation `i`
(with `n` above 1, choice `i * n + j`). Streaming is refused, as vLLM does; so are tools, which a batch
cannot carry per conversation.
"""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Request
from msgspec import Meta

from loraserve.errors import BadRequest
from loraserve.inference.prompts import (
    MAX_PROMPTS,
    chat_prompt,
    check_output_room,
    check_sampling_token_ids,
    message_text,
    truncation,
)
from loraserve.inference.responses import ChatFormat
from loraserve.inference.sampling import chat_params
from loraserve.inference.schemas import ChatCompletionRequest, ChatMessage
from loraserve.inference.service import _admit, _generate, _logprobs_cap, check_serving
from loraserve.inference.structured import check_structured
from loraserve.services import Services
from loraserve.tenancy import Principal

Conversation = Annotated[list[ChatMessage], Meta(min_length=1)]


class BatchChatCompletionRequest(ChatCompletionRequest, frozen=True, kw_only=True):
    messages: Annotated[list[Conversation], Meta(min_length=1, max_length=MAX_PROMPTS)]  # type: ignore[assignment]


async def create_batch_chat_completion(
    services: Services, principal: Principal, body: BatchChatCompletionRequest, request: Request
) -> Any:
    check_serving(services)
    if body.stream:
        raise BadRequest("streaming is not supported for batched chat completions", param="stream")
    if getattr(body, "tools", None):
        raise BadRequest("tools are not supported for batched chat completions", param="tools")
    params = chat_params(body, services.sampling_defaults, _logprobs_cap(services))
    check_sampling_token_ids(params, services.tokenizer)
    resolved, lease = await _admit(services, principal, body)
    try:
        await check_structured(services, params.structured_outputs)
        prompts = await services.work_pool.run(_render, services, body)
        check_output_room(params.max_tokens, prompts, services.max_model_len)
        # as for one chat: echo repeats a conversation's last message when it is the assistant's
        echo = (
            [message_text(c[-1]) if c[-1].role == "assistant" else "" for c in body.messages]
            if body.echo
            else None
        )
        return await _generate(
            services,
            principal,
            body,
            prompts,
            params,
            ChatFormat,
            "chatcmpl",
            request,
            resolved,
            lease,
            echo,
        )
    except BaseException:
        lease.release()  # idempotent: a started generation releases it itself
        raise


def _render(services: Services, body: BatchChatCompletionRequest) -> list[list[int]]:
    """Each conversation's prompt, rendered with the chat template (in the tokenizer pool)."""
    return [
        chat_prompt(
            conversation,
            services.tokenizer,
            services.max_model_len,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            truncate=truncation(body),
        )
        for conversation in body.messages
    ]
