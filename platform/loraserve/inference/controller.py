"""POST /v1/completions, POST /v1/chat/completions (and vLLM's /batch), GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from loraserve.inference.chat_batch import BatchChatCompletionRequest, create_batch_chat_completion
from loraserve.inference.schemas import ChatCompletionRequest, CompletionRequest
from loraserve.inference.service import create_chat_completion, create_completion, create_invocation
from loraserve.json_guard import require_json_body
from loraserve.openapi import BEARER_SECURITY
from loraserve.resolution import ModelCard, ModelList, list_models, retrieve_model
from loraserve.services import Services
from loraserve.tenancy import Principal


class InferenceController(Controller):
    guards = [require_json_body]
    path = "/v1"
    tags = ["inference"]
    security = BEARER_SECURITY

    @post("/completions", status_code=200, summary="Complete prompts (OpenAI's completions; SSE with stream)")
    async def completions(
        self,
        data: JSONBody[CompletionRequest],
        request: Request,
        services: NamedDependency[Services],
        principal: NamedDependency[Principal],
    ) -> Any:
        return await create_completion(services, principal, data, request)

    @post(
        "/chat/completions",
        status_code=200,
        summary="Answer a chat (OpenAI's chat completions; SSE with stream)",
    )
    async def chat_completions(
        self,
        data: JSONBody[ChatCompletionRequest],
        request: Request,
        services: NamedDependency[Services],
        principal: NamedDependency[Principal],
    ) -> Any:
        return await create_chat_completion(services, principal, data, request)

    @post(
        "/chat/completions/batch",
        status_code=200,
        summary="vLLM's batched chat: several conversations, one answer with a choice each",
    )
    async def chat_completions_batch(
        self,
        data: JSONBody[BatchChatCompletionRequest],
        request: Request,
        services: NamedDependency[Services],
        principal: NamedDependency[Principal],
    ) -> Any:
        return await create_batch_chat_completion(services, principal, data, request)

    @get("/models", summary="The base model, the tenant's adapters and routes")
    async def models(
        self, services: NamedDependency[Services], principal: NamedDependency[Principal]
    ) -> ModelList:
        return await list_models(services, principal)

    @get("/models/{model_id:path}", summary="One model of the list (the SDK's models.retrieve)")
    async def model(
        self,
        model_id: FromPath[str],
        services: NamedDependency[Services],
        principal: NamedDependency[Principal],
    ) -> ModelCard:
        return await retrieve_model(services, principal, model_id.lstrip("/"))


@post(
    "/invocations",
    status_code=200,
    tags=["inference"],
    security=BEARER_SECURITY,
    guards=[require_json_body],
    summary="SageMaker's entry: chat or completion",
)
async def invocations(
    data: JSONBody[dict[str, Any]],
    request: Request,
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Any:
    """A body with `messages` is a chat completion, one with `prompt` a completion (SageMaker's convention)."""
    return await create_invocation(services, principal, data, request)
