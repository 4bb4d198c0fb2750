"""Streaming API for servers: submit a request, iterate its deltas, abort it; the engine runs in its own process.

`AsyncLLM.from_config(config, ...)` starts the engine core process (engine.core_process) and talks to it only
through engine.messages; `AsyncLLM.connect(addresses, client_id, ...)` joins a core another process
started, as one of several front-end processes (`loraserve serve --api-server-count N`). Tokenization of text prompts, detokenization, stop strings, logprobs and the
`n > 1` fan-in happen here, in the caller's process, on the event loop of the coroutine that iterates
(engine.frontend.output_processor). A consumer that stops iterating (client disconnect, cancellation)
aborts its request in the core, which frees its KV blocks.

The receiver thread (engine.frontend.core_client) hands each step's deltas to the streams' event loops
and keeps the latest EngineStats snapshot. If the core dies, every open stream raises EngineDeadError,
new requests are refused with it, and the death callbacks run (the server exits on them).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from adapter_format.events import Observer, emit
from engine.config import EngineConfig
from engine.core.request_checks import RequestError
from engine.core.steady import CpuPlan
from engine.core_process.handle import CoreAddresses, CoreHandle, CoreWatch
from engine.frontend.core_client import DEFAULT_STARTUP_TIMEOUT_S, CoreClient, EngineDeadError
from engine.frontend.output_processor import Prompt, new_request
from engine.messages import (
    AbortRequests,
    ForgetAdapter,
    PreloadAdapters,
    RequestDelta,
    StepOutputs,
    UnpinAdapters,
    decode_stats,
    encode_stats,
)
from engine.model.loader import resolve_model_path
from engine.outputs import RequestOutput
from engine.request_meta import RequestMeta, with_priority
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # lists of RequestDelta, or the EngineDeadError that ends the stream
    child_ids: list[str]  # its core requests


class AsyncLLM:
    def __init__(
        self,
        client: CoreClient,
        tokenizer: Any = None,
        adapter_source: Any = None,
        adapter_observer: Observer | None = None,
        handle: CoreHandle | None = None,
        core_pid: int | None = None,
    ):
        """Wrap a connected client (waits for its CoreReady); `handle`: the core this front end started and
        stops on shutdown (None: another process owns it). Prefer `from_config` or `connect`."""
        ready = client.ready or client.wait_ready()
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.eos_token_ids = list(ready.eos_token_ids)
        self._client = client
        self._handle = handle
        self._core_pid = handle.pid if handle is not None else core_pid
        self._adapter_source = adapter_source
        self._adapter_observer = adapter_observer
        self._streams: dict[str, _Stream] = {}  # user request id -> stream
        self._children: dict[str, _Stream] = {}  # core request id -> the stream of its user request
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._died: EngineDeadError | None = None  # set when the core died (not when shut down)
        # The latest snapshot as the core encoded it, and its decoded form (decoded when first read). The
        # receiver thread replaces the first; reading one attribute needs no lock.
        self._stats_raw = encode_stats(ready.stats)
        self._stats_decoded: tuple[Any, EngineStats] = (self._stats_raw, ready.stats)
        client.run(self._on_outputs, self._on_dead)

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        tokenizer: Any = None,
        skip_tokenizer_init: bool = False,
        adapter_source: Any = None,
        adapter_observer: Observer | None = None,
        lora_modules: dict[str, str] | None = None,
        triton_cache_dir: str | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        cpu_plan: CpuPlan | None = None,
    ) -> AsyncLLM:
        """Start the engine core process and wait (at most `startup_timeout_s`) until it serves.

        `adapter_source` must pickle (adapters_store's StoreAdapterSource does); what it and the core's
        adapter manager observe comes back here: `adapter_observer(event, tier, seconds)` and
        `adapter_source.replay(records)`. `lora_modules` are local PEFT folders registered by name.
        `cpu_plan`: where the core's loop runs (engine.core.steady.plan_cpus); None: anywhere.
        """
        handle = CoreHandle.start(
            config,
            adapter_source=adapter_source,
            lora_modules=tuple((lora_modules or {}).items()),
            triton_cache_dir=triton_cache_dir,
            skip_tokenizer_init=skip_tokenizer_init,
            cpu_plan=cpu_plan,
        )
        client = None
        try:
            client = CoreClient.connect(handle.addresses, f"fe-0-{os.getpid()}", handle.watch())
            if tokenizer is None and not skip_tokenizer_init:  # while the core loads the model
                tokenizer = load_tokenizer(resolve_model_path(config.model))
            client.wait_ready(startup_timeout_s)
        except BaseException:
            if client is not None:
                client.close()
            handle.shutdown()
            raise
        return cls(client, tokenizer, adapter_source, adapter_observer, handle)

    @classmethod
    def connect(
        cls,
        addresses: CoreAddresses,
        client_id: str,
        *,
        tokenizer: Any = None,
        adapter_source: Any = None,
        adapter_observer: Observer | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> AsyncLLM:
        """Join a core another process started (a front-end process of several), as client `client_id`
        (unique among the core's clients); waits (at most `startup_timeout_s`) until the core serves.
        Its death fails this front end's streams as it would the starter's; shutdown leaves it running."""
        client = CoreClient.connect(addresses, client_id, CoreWatch.of_pid(addresses.pid))
        try:
            client.wait_ready(startup_timeout_s)
        except BaseException:
            client.close()
            raise
        return cls(client, tokenizer, adapter_source, adapter_observer, core_pid=addresses.pid)

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine core stopped; None while it serves."""
        return self._client.dead_error

    @property
    def core_pid(self) -> int | None:
        return self._core_pid

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str,
        adapter: str | None = None,
        *,
        meta: RequestMeta | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas: each output's completions hold only the text, tokens and logprobs that are new
        since the previous yield. The last one has `finished` set; a failed request's has `error`.
        `meta` (tenant, weight, priority, cache salt) and vLLM's `priority`: see LLMEngine.add_request."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        meta = with_priority(meta, priority)
        request, failed = new_request(
            request_id, prompt, params or SamplingParams(), adapter, self.tokenizer, self.eos_token_ids
        )
        if any(child_id in self._children for child_id in request.child_ids):  # `x#0` beside `x`, n > 1
            raise ValueError(f"request id {request_id!r} is already in use")
        if failed is not None:
            yield failed
            return
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), request.child_ids)
        self._streams[request_id] = stream
        for child_id in request.child_ids:
            self._children[child_id] = stream
        try:
            try:
                self._client.send(*request.add_requests(meta))
            except (OverflowError, msgspec.EncodeError) as exc:  # e.g. an integer wider than 64 bits
                raise RequestError(f"the request holds a value the engine cannot take: {exc}") from None
            while not request.finished:
                item = await stream.queue.get()
                # A consumer that fell behind takes everything waiting as one output: under load the
                # stream sends fewer, larger chunks instead of falling further behind.
                while not isinstance(item, BaseException) and not stream.queue.empty():
                    more = stream.queue.get_nowait()
                    item = more if isinstance(more, BaseException) else item + more
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                output, to_abort = request.process(item)
                if to_abort:  # a stop string ended these children here: free them in the core
                    self._abort_quietly(to_abort)
                if output is not None:
                    yield output
        finally:
            self._streams.pop(request_id, None)
            for child_id in request.child_ids:
                self._children.pop(child_id, None)
            if not request.finished:
                self._abort_quietly(request.unfinished_child_ids)

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason 'abort' (unknown ids are ignored)."""
        stream = self._streams.get(request_id)
        self._abort_quietly(stream.child_ids if stream is not None else [request_id])

    def forget_adapter(self, adapter_id: str) -> None:
        """An adapter was deleted (see LLMEngine.forget_adapter); safe from any thread, returns at once."""
        try:
            self._client.send(ForgetAdapter(adapter_id))
        except EngineDeadError:
            pass  # nothing left to forget in

    def preload_adapters(self, adapter_ids: list[str], level: str = "cpu", pin: bool = False) -> None:
        """Have the core start loading these adapters into its CPU tier or, with `level="gpu"`, a GPU slot
        (`pin`: kept there until `unpin_adapters`); see LLMEngine.preload_adapters. Returns at once."""
        self._client.send(PreloadAdapters(list(adapter_ids), level, pin))

    def unpin_adapters(self, adapter_ids: list[str], unload: bool = False) -> None:
        """Drop an operator's pins (see LLMEngine.unpin_adapters); returns at once."""
        self._client.send(UnpinAdapters(list(adapter_ids), unload))

    def stats(self) -> EngineStats:
        """The latest snapshot the core published (at most a step, or
        engine.core_process.clients.STATS_INTERVAL_S, old)."""
        raw = self._stats_raw
        cached_raw, stats = self._stats_decoded
        if raw is not cached_raw:
            stats = decode_stats(raw)
            self._stats_decoded = (raw, stats)
        return stats

    def add_death_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` once if the core dies (on the receiver thread; at once if it has)."""
        self._death_callbacks.append(callback)
        if self._died is not None:
            callback(self._died)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Close this front end's connection and, if it started the core, stop the core (bounded); open
        streams end with EngineDeadError."""
        self._client.close()
        if self._handle is not None:
            self._handle.shutdown(timeout)
        self._fail_streams(self._client.dead_error or EngineDeadError("the engine was shut down"))

    # -- the receiver thread ----------------------------------------------------------------------

    def _on_outputs(self, outputs: StepOutputs) -> None:
        self._stats_raw = outputs.stats
        for event, tier, seconds in outputs.adapter_events:
            emit(self._adapter_observer, event, tier, seconds)
        replay = getattr(self._adapter_source, "replay", None)
        if outputs.source_records and replay is not None:
            try:
                replay(outputs.source_records)
            except Exception:  # metrics must never stop serving
                logger.exception("replaying the engine core's adapter records failed")
        batches: dict[asyncio.AbstractEventLoop, dict[_Stream, list[RequestDelta]]] = {}
        for delta in outputs.deltas:
            stream = self._children.get(delta.request_id)
            if stream is not None:  # else its consumer has left
                batches.setdefault(stream.loop, {}).setdefault(stream, []).append(delta)
        for loop, per_stream in batches.items():  # one wake-up per event loop, not per request
            _call_soon(loop, _deliver, per_stream)

    def _on_dead(self, error: EngineDeadError) -> None:
        self._died = error
        for callback in self._death_callbacks:  # first: by the time a stream fails, the server knows
            try:
                callback(error)
            except Exception:
                logger.exception("an engine death callback failed")
        self._fail_streams(error)

    def _fail_streams(self, error: EngineDeadError) -> None:
        for stream in list(self._streams.values()):
            _call_soon(stream.loop, stream.queue.put_nowait, error)

    def _abort_quietly(self, child_ids: list[str]) -> None:
        if not child_ids:
            return
        try:
            self._client.send(AbortRequests(list(child_ids)))
        except EngineDeadError:
            pass  # a dead core holds nothing to free


def _deliver(per_stream: dict[_Stream, list[RequestDelta]]) -> None:
    for stream, deltas in per_stream.items():
        stream.queue.put_nowait(deltas)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop is closed: nobody is left to read the stream
        pass
