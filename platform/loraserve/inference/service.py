"""Completions and chat completions: admit, resolve the model, run the engine, answer whole or as SSE.

Order of checks, cheapest first, so that no costly work is done for a request that will be refused:
draining / model loaded (503), the body's fields (400), the tenant's model name (404), the tenant's
concurrency limit (429); only then the work that grows with the request (the structured-output spec's
checks, chat template, tokenizing: 400 for a bad spec or prompt), on the work pool, off the event loop;
then the tenant's tokens per minute (429), which needs the prompt's length. A stream's headers go out
only once the engine has produced its first delta, so a request that fails at once (its grammar refused
by the engine, say) still gets a proper HTTP error instead of a broken stream; until then the client's
disconnect is watched, as for a whole answer, so a client that leaves while its request waits in the
queue aborts it there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from engine import EngineDeadError, RequestOutput, SamplingParams
from engine.request_meta import RequestMeta
from loraserve.errors import (
    APIError,
    BadRequest,
    ServiceUnavailable,
    error_event,
    public_message,
    status_and_code,
)
from loraserve.inference.generation import Generation
from loraserve.inference.logprobs import TokenText
from loraserve.inference.prompts import (
    chat_prompt,
    check_output_room,
    check_sampling_token_ids,
    completion_prompts,
    message_text,
    truncation,
)
from loraserve.inference.responses import ChatFormat, Choices, CompletionFormat, ResponseOptions, sse_event
from loraserve.inference.sampling import LogprobsCap, chat_params, completion_params, echo_only
from loraserve.inference.schemas import ChatCompletionRequest, CompletionRequest
from loraserve.inference.structured import check_structured
from loraserve.inference.tools import ToolPlan, plan_tools
from loraserve.ops.readiness import engine_dead_reason
from loraserve.resolution import ResolvedModel, resolve_model
from loraserve.services import Services
from loraserve.tenancy import Lease, Principal, TooManyRequests, engine_cache_salt

log = logging.getLogger(__name__)

VARIANT_HEADER = "x-loraserve-variant"
DONE_EVENT = b"data: [DONE]\n\n"
Format = CompletionFormat | ChatFormat
Events = AsyncIterator[tuple[int, RequestOutput]]


async def create_completion(
    services: Services, principal: Principal, body: CompletionRequest, request: Request
) -> Any:
    check_serving(services)
    params = completion_params(body, services.sampling_defaults, _logprobs_cap(services))
    check_sampling_token_ids(params, services.tokenizer)
    resolved, lease = await _admit(services, principal, body)
    try:
        await check_structured(services, params.structured_outputs)
        pool, tokenizer = services.work_pool, services.tokenizer
        prompts = await pool.run(
            completion_prompts, body.prompt, tokenizer, services.max_model_len, truncation(body)
        )
        check_output_room(params.max_tokens, prompts, services.max_model_len)
        echo = await pool.run(_echo_texts, body, prompts, tokenizer) if body.echo else None
        return await _generate(
            services,
            principal,
            body,
            prompts,
            params,
            CompletionFormat,
            "cmpl",
            request,
            resolved,
            lease,
            echo,
        )
    except BaseException:
        lease.release()  # idempotent: a started generation releases it itself
        raise


async def create_chat_completion(
    services: Services, principal: Principal, body: ChatCompletionRequest, request: Request
) -> Any:
    check_serving(services)
    tools = plan_tools(body)
    params = chat_params(body, services.sampling_defaults, _logprobs_cap(services))
    params = tools.constrain(params) if tools is not None else params
    check_sampling_token_ids(params, services.tokenizer)
    resolved, lease = await _admit(services, principal, body)
    try:
        try:
            await check_structured(services, params.structured_outputs)
        except BadRequest as exc:  # under a named or "required" tool_choice the grammar is the tools' schemas
            if tools is None or tools.mode in ("none", "auto"):
                raise
            raise BadRequest(f"a tool's parameters schema cannot be used: {exc}", param="tools") from None
        prompt = await services.work_pool.run(
            chat_prompt,
            body.messages,
            services.tokenizer,
            services.max_model_len,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            truncate=truncation(body),
            tools=tools.template_tools() if tools is not None else None,
        )
        check_output_room(params.max_tokens, [prompt], services.max_model_len)
        # vLLM's chat echo: the last message's content, when it is the assistant's (the reply continues it)
        last = body.messages[-1]
        echo = [message_text(last)] if body.echo and last.role == "assistant" else None
        return await _generate(
            services,
            principal,
            body,
            [prompt],
            params,
            ChatFormat,
            "chatcmpl",
            request,
            resolved,
            lease,
            echo,
            tools,
        )
    except BaseException:
        lease.release()
        raise


async def create_invocation(
    services: Services, principal: Principal, body: dict[str, Any], request: Request
) -> Any:
    """SageMaker's /invocations: the body's shape picks the endpoint, then it is validated as that one's."""
    if ("messages" in body) == ("prompt" in body):
        raise BadRequest("an invocation needs either messages (chat) or prompt (completion)")
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    try:
        parsed = msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request body: {exc}") from None
    if isinstance(parsed, ChatCompletionRequest):
        return await create_chat_completion(services, principal, parsed, request)
    return await create_completion(services, principal, parsed, request)


def _logprobs_cap(services: Services) -> LogprobsCap:
    vocab = len(services.tokenizer) if services.tokenizer is not None else None
    return LogprobsCap(services.max_logprobs, vocab)


def check_serving(services: Services) -> None:
    dead = engine_dead_reason(services)
    if dead is not None:  # first: a dead core also starts the shutdown
        raise ServiceUnavailable(f"{dead}; retry on another replica", code="engine_dead")
    if services.shutdown is not None and services.shutdown.draining:
        raise ServiceUnavailable(
            "the server is shutting down; retry on another replica", code="server_shutting_down"
        )
    if services.engine is None:
        raise ServiceUnavailable("the model is still loading; retry shortly", code="model_not_ready")


async def _admit(
    services: Services, principal: Principal, body: CompletionRequest | ChatCompletionRequest
) -> tuple[ResolvedModel, Lease]:
    """The model the tenant named (404 if it has none of that name) and a concurrency lease (429 beyond
    its cap), before any work that grows with the request; the caller releases the lease if it fails."""
    resolved = await resolve_model(services, principal, body.model, body.user, body.merged_adapters)
    try:
        return resolved, services.limiter.try_acquire(principal)
    except TooManyRequests:
        _count_refusal(services, principal, "concurrency")
        raise


async def _generate(
    services: Services,
    principal: Principal,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    params: SamplingParams,
    format_type: type[Format],
    prefix: str,
    request: Request,
    resolved: ResolvedModel,
    lease: Lease,
    echo: list[str] | None = None,
    tools: ToolPlan | None = None,
) -> Any:
    # "auto" reads calls with the adapter's own parser, else the server's (a 400 when there is neither)
    tool_output = tools.output(resolved.tool_call_parser or services.tool_call_parser) if tools else None
    if tool_output is not None and tool_output.needs_special_tokens(services.tokenizer):
        params = dataclasses.replace(params, skip_special_tokens=False)
    try:
        tokens = services.token_limiter.try_reserve(
            principal, sum(map(len, prompts)), len(prompts) * params.n * (params.max_tokens or 0)
        )
    except TooManyRequests:  # the caller releases the lease
        _count_refusal(services, principal, "tokens")
        raise
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    if services.metrics is not None and resolved.engine_adapter_id is not None:
        services.metrics.adapter_request(resolved.engine_adapter_id)
    generation = Generation(
        services,
        response_id,
        prompts,
        params,
        resolved.engine_adapter_id,
        lease,
        tokens,
        meta=RequestMeta(
            tenant=principal.tenant,
            tenant_weight=principal.weight,
            priority=body.priority,
            cache_salt=engine_cache_salt(principal, body.cache_salt),
        ),
    )
    options = ResponseOptions(
        want_logprobs=params.logprobs is not None,
        return_token_ids=body.return_token_ids,
        prompts=prompts,
        echo=echo,
        prompt_logprobs=params.prompt_logprobs is not None,
        echo_logprobs=echo is not None
        and isinstance(body, CompletionRequest)
        and params.logprobs is not None,
        tools=tool_output,
    )
    text = TokenText(services.tokenizer, body.return_tokens_as_token_ids or services.tokens_as_token_ids)
    fmt = format_type(response_id, resolved.served_model, text, options)
    headers = {VARIANT_HEADER: resolved.served_model}
    choices = Choices(
        params.n,
        params.logprobs is not None,
        keep_token_ids=body.return_token_ids,
        drop_generated=isinstance(body, CompletionRequest) and echo_only(body),
        cached_tokens_details=services.prompt_tokens_details,
    )
    if not body.stream:
        await _until_done_or_disconnected(_collect(generation, choices), request, generation)
        return Response(fmt.whole(choices, choices.usage(generation.num_prompt_tokens)), headers=headers)
    options = body.stream_options
    # --enable-force-include-usage: usage in every chunk and at the end, whatever the request says
    include_usage = services.force_include_usage or (options is not None and options.usage)
    continuous_usage = services.force_include_usage or (options is not None and options.continuous_usage)
    events = generation.events()
    try:  # no response has started yet: a client that leaves before the first delta aborts it here
        first = await _until_done_or_disconnected(_first(events), request, generation)
    except BaseException:
        generation.close()
        raise
    sse = _sse(first, events, choices, fmt, include_usage, continuous_usage, generation)
    return EventStream(sse, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})


def _count_refusal(services: Services, principal: Principal, limit: str) -> None:
    if services.metrics is not None:
        services.metrics.tenant_rate_limited(principal.tenant, limit)


async def _collect(generation: Generation, choices: Choices) -> None:
    async for index, delta in generation.events():
        choices.add(index, delta)


async def _first(events: Events) -> tuple[int, RequestOutput] | None:
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


async def _until_done_or_disconnected(work: Any, request: Request, generation: Generation) -> Any:
    """Run `work` and return its result; if the client hangs up first, abort the engine requests (and
    release the tenant's lease) at once instead of finishing them."""
    work_task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if not work_task.done():
        work_task.cancel()
        generation.close()
        raise BadRequest("the client disconnected; the request was aborted", code="client_disconnected")
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(
    first: tuple[int, RequestOutput] | None,
    events: Events,
    choices: Choices,
    fmt: Format,
    include_usage: bool,
    continuous_usage: bool,
    generation: Generation,
) -> AsyncIterator[bytes]:
    """`data: {chunk}` events, one choice each (as OpenAI and vLLM send them with n > 1), an optional usage
    chunk, then `data: [DONE]`; failures become an error event. Only the usage chunk has no choices."""

    def chunks(index: int, delta: RequestOutput) -> list[bytes]:
        changed = choices.add(index, delta)
        if len(changed) == 1 and not continuous_usage:  # the usual chunk: text only, from a template
            event = fmt.plain_text_event(choices, *changed[0])
            if event is not None:
                return [event]
        usage = choices.usage(generation.num_prompt_tokens) if continuous_usage else None
        events = []
        for item in changed:
            choice = choices.by_index[item[0]]
            if isinstance(fmt, ChatFormat) and not choice.opened:  # the role alone first, as OpenAI
                choice.opened = True
                before = None
                if continuous_usage:  # the opening chunk precedes this delta's tokens
                    before = choices.usage(generation.num_prompt_tokens, len(item[1].token_ids))
                events.append(sse_event(fmt.opening(choices, item[0], before)))
            chunk = fmt.chunk(choices, [item], usage)
            if chunk is not None:  # None: text a tool parser holds back
                events.append(sse_event(chunk))
        return events

    try:
        if first is not None:
            for event in chunks(*first):
                yield event
        async for index, delta in events:
            for event in chunks(index, delta):
                yield event
        if include_usage:
            yield sse_event(fmt.usage_chunk(choices.usage(generation.num_prompt_tokens)))
    except APIError as exc:
        status, code = status_and_code(exc) or (503, "generation_failed")  # ERROR_TABLE has every APIError
        yield error_event(status, str(exc), code)
    except EngineDeadError as exc:  # the engine core died mid-stream: the server is going down
        log.warning("stream %s failed: %s", generation.request_id, exc)
        yield error_event(503, public_message(exc), "engine_dead")
    except Exception as exc:  # the engine died mid-stream: tell the client rather than cut the connection
        log.warning("stream %s failed: %s", generation.request_id, exc)
        yield error_event(503, "the request failed on the server; retry it", "generation_failed")
    finally:
        generation.close()
    yield DONE_EVENT


def _echo_texts(body: CompletionRequest, prompts: list[list[int]], tokenizer: Any) -> list[str]:
    """The prompts as completions' echo repeats them: as sent when sent as text (vLLM's; decoding would
    add the tokenizer's special tokens), else decoded from the ids the model saw."""
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if body.truncate_prompt_tokens is None and all(isinstance(t, str) for t in texts):
        return list(texts)
    return [tokenizer.decode(p) if tokenizer is not None else "" for p in prompts]


class EventStream(Stream):
    """A Stream whose own media type wins over the handler's JSON default (Litestar prefers the handler's)."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = self.media_type
        return super().to_asgi_response(*args, **kwargs)
