"""POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's paths: at the root, not under /v1)."""

from __future__ import annotations

from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from loraserve.json_guard import require_json_body
from loraserve.openapi import BEARER_SECURITY
from loraserve.services import Services
from loraserve.tenancy import Principal
from loraserve.tokenization.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from loraserve.tokenization.service import detokenize, tokenize, tokenizer_info


class TokenizationController(Controller):
    guards = [require_json_body]
    tags = ["tokenizer"]
    security = BEARER_SECURITY

    @post("/tokenize", status_code=200, summary="Tokenize a prompt or chat messages as the server does")
    async def tokenize(
        self,
        data: JSONBody[TokenizeRequest],
        services: NamedDependency[Services],
        principal: NamedDependency[Principal],
    ) -> TokenizeResponse:
        return await tokenize(services, principal, data)

    @post("/detokenize", status_code=200, summary="Turn token ids back into text")
    async def detokenize(
        self,
        data: JSONBody[DetokenizeRequest],
        services: NamedDependency[Services],
        principal: NamedDependency[Principal],
    ) -> DetokenizeResponse:
        return await detokenize(services, principal, data)

    @get("/tokenizer_info", summary="The served model's tokenizer settings")
    async def tokenizer_info(
        self, services: NamedDependency[Services], principal: NamedDependency[Principal]
    ) -> TokenizerInfo:
        return tokenizer_info(services)
