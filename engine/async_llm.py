"""Streaming API for servers: submit a request, iterate its deltas, abort it.

One background thread owns the engine and runs its step loop; coroutines talk to it through a
command queue and receive outputs through per-request asyncio queues. A consumer that stops
iterating (client disconnect, cancellation) aborts its request, which frees its KV blocks.
After every step, and while idle, the engine thread publishes an immutable `EngineStats` snapshot that
any thread may read without touching the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; no request can be served any more."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.dead_error: BaseException | None = None
        # Replaced (never mutated) by the engine thread; reading one attribute needs no lock.
        self._stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **engine_kwargs) -> AsyncLLM:
        return cls(LLMEngine(config, **engine_kwargs))

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str,
        adapter: str | None = None,
        *,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas: each output's completions hold only the text, tokens and logprobs that are new
        since the previous yield. The last one has `finished` set; a failed request's has `error`.
        `tenant` and `tenant_weight`: see LLMEngine.add_request."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead_error}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._submit(("add", request_id, prompt, params, adapter, tenant, tenant_weight))
        seen: dict[int, tuple[int, int, int]] = {}
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item}") from item
                finished = item.finished
                yield _delta(item, seen)
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def forget_adapter(self, adapter_id: str) -> None:
        """An adapter was deleted (see LLMEngine.forget_adapter); safe from any thread, returns at once."""
        self._submit(("forget", adapter_id))

    def stats(self) -> EngineStats:
        """The latest snapshot the engine thread published (at most one step or one idle wait old)."""
        return self._stats

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout)
        self.engine.shutdown()

    # -- the engine thread ------------------------------------------------------------------------

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._stats = self.engine.stats()
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
                self._stats = self.engine.stats()
            except Exception as exc:  # an engine bug: fail every stream rather than hang them
                logger.exception("engine loop failed")
                self.dead_error = exc
                for request_id in list(self._streams):
                    self._deliver(request_id, exc)
                return

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, adapter, tenant, tenant_weight = command
                try:
                    self.engine.add_request(
                        request_id, prompt, params, adapter, tenant=tenant, tenant_weight=tenant_weight
                    )
                except ValueError as exc:  # e.g. bad sampling params: fail this request alone
                    self._deliver(request_id, _failed(request_id, prompt, str(exc)))
                except Exception as exc:  # a bug met by this request's data: still this request alone
                    logger.exception("adding request %s failed", request_id)
                    self._deliver(
                        request_id, _failed(request_id, prompt, f"the request could not start: {exc}")
                    )
            elif command[0] == "forget":
                self.engine.forget_adapter(command[1])
            else:
                self.engine.abort_request(command[1])

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)


def _failed(request_id: str, prompt: Prompt, message: str) -> RequestOutput:
    text, ids = (prompt, []) if isinstance(prompt, str) else (None, list(prompt))
    completion = CompletionOutput(0, "", [], None, None, "error", None)
    return RequestOutput(request_id, text, ids, [completion], True, None, message)


def _delta(output: RequestOutput, seen: dict[int, tuple[int, int, int]]) -> RequestOutput:
    """Cut the cumulative completions down to what is new; `seen` holds what was already yielded."""
    completions = []
    for c in output.outputs:
        text_len, token_len, logprob_len = seen.get(c.index, (0, 0, 0))
        completions.append(
            CompletionOutput(
                index=c.index,
                text=c.text[text_len:],
                token_ids=c.token_ids[token_len:],
                cumulative_logprob=c.cumulative_logprob,
                logprobs=c.logprobs[logprob_len:] if c.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
        seen[c.index] = (len(c.text), len(c.token_ids), len(c.logprobs or []))
    return dataclasses.replace(output, outputs=completions)
