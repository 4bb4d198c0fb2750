"""One HTTP request's engine requests (one per prompt), merged into one stream of deltas.

Each prompt becomes an engine request `{id}-{i}` carrying all `n` completions of that prompt. Events
are `(prompt_index, RequestOutput delta)`. Generated tokens are charged to the tenant's token-rate
window as each delta arrives. Closing the stream (client gone, handler done, shutdown) aborts whatever
is still running, which frees its KV blocks; the tenant's lease and the rest of its token hold are
released, and every completion is counted in `vllm:request_success_total` by its finish reason (one
that never got one: `abort`, or `error` when the engine failed it), exactly once, however the stream
ends. Engine requests carry one RequestMeta (engine/request_meta.py): the caller's tenant and weight
(the fair policy's key), the request's priority, and the cache salt that keeps its prefix cache to
itself (loraserve.tenancy.cache_salt).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine import EngineDeadError, RequestOutput, SamplingParams
from engine.outputs import RequestTimes
from engine.request_meta import RequestMeta
from loraserve.errors import BadRequest, ServiceUnavailable
from loraserve.services import Services
from loraserve.tenancy import Lease, TokenReservation

_DONE = object()


class GenerationFailed(ServiceUnavailable):
    """The engine failed a request it had accepted (e.g. its adapter could not be loaded)."""

    code = "generation_failed"


@dataclass
class _Timing:
    """Per engine request, for the latency and size histograms and the finish-reason counter."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between consecutive deltas that carried tokens
    finish_reasons: list[str] = field(default_factory=list)  # one per completion of the request
    times: list[RequestTimes] = field(default_factory=list)  # the engine's phases, per finished completion


class Generation:
    def __init__(
        self,
        services: Services,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        adapter: str | None,
        lease: Lease,
        tokens: TokenReservation | None = None,
        meta: RequestMeta | None = None,
    ) -> None:
        self.services = services
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.adapter = adapter
        self.lease = lease
        self.tokens = tokens
        self.meta = meta if meta is not None else RequestMeta()
        self.ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._timings = [_Timing() for _ in prompts]
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        # The finish reason of completions the engine never finished: set when the engine failed them.
        self._unfinished_reason = "abort"
        if services.server_load is not None:  # until close(), however the request ends
            services.server_load.enter()

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def has_tokens(self) -> bool:
        """True once any prompt has produced a token."""
        return any(t.first_token is not None for t in self._timings)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of every prompt as they come; raises GenerationFailed / ServiceUnavailable on failure."""
        shutdown = self.services.shutdown
        if shutdown is not None:
            shutdown.track(self)
        try:
            if len(self.prompts) == 1:  # one engine stream: read it in this task, no pump and queue between
                async for delta in self._deltas(0):
                    self._check(delta)
                    yield 0, delta
                return
            self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.prompts))]
            remaining = len(self._tasks)
            while remaining:
                item = await self._queue.get()
                if item is _DONE:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                index, delta = item
                self._check(delta)
                yield index, delta
        except (GenerationFailed, EngineDeadError):
            self._unfinished_reason = "error"
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Abort what still runs and release the lease; synchronous, so it is safe under cancellation."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()  # each pump's engine stream submits its own abort as it unwinds
        if self.services.shutdown is not None:
            self.services.shutdown.untrack(self)
        self.lease.release()
        if self.services.server_load is not None:
            self.services.server_load.leave()
        if self.tokens is not None:
            self.tokens.release()
        self._count_finished()

    async def abort_for_shutdown(self) -> None:
        """Called by the drain: the engine answers each request with finish_reason 'abort'."""
        for request_id in self.ids:
            await self.services.engine.abort(request_id)

    async def _deltas(self, index: int) -> AsyncIterator[RequestOutput]:
        """Prompt `index`'s engine stream, its timings recorded (and observed once it ends)."""
        timing = self._timings[index]
        stream = self.services.engine.generate(
            self.prompts[index], self.params, self.ids[index], self.adapter, meta=self.meta
        )
        async for delta in stream:
            new_tokens = _record(timing, delta)
            if self.tokens is not None:
                self.tokens.charge(new_tokens)
            yield delta
        self._observe(index)

    async def _pump(self, index: int) -> None:
        """Several prompts: each stream is read by a task of its own into the shared queue."""
        try:
            async for delta in self._deltas(index):
                self._queue.put_nowait((index, delta))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EngineDeadError and the like: the consumer raises it
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(_DONE)

    def _check(self, delta: RequestOutput) -> None:
        shutdown = self.services.shutdown
        if (
            shutdown is not None
            and shutdown.aborted(self)
            and any(c.finish_reason == "abort" for c in delta.outputs)
        ):
            raise ServiceUnavailable(
                "the server is shutting down and stopped this request; retry it on another replica",
                code="server_shutting_down",
            )
        if delta.error is not None and delta.error_code is not None:  # the request's own data: the caller's
            raise BadRequest(delta.error, code=delta.error_code)
        if delta.error is not None:
            raise GenerationFailed(f"the request failed: {delta.error}")

    def _count_finished(self) -> None:
        """Every completion once, by finish reason; one without a reason ended here (client gone, stream
        cut, server stopping) or with the engine (failed, died)."""
        metrics = self.services.metrics
        if metrics is None:
            return
        reasons = []
        for timing in self._timings:
            missing = max(0, self.params.n - len(timing.finish_reasons))
            reasons.extend([*timing.finish_reasons, *[self._unfinished_reason] * missing])
        metrics.count_finished(reasons)

    def _observe(self, index: int) -> None:
        timing = self._timings[index]
        metrics = self.services.metrics
        if metrics is None or timing.first_token is None:
            return
        end = time.perf_counter()
        tpot = (end - timing.first_token) / (timing.num_tokens - 1) if timing.num_tokens > 1 else None
        metrics.observe_request(
            ttft=timing.first_token - timing.start,
            tpot=tpot,
            e2e=end - timing.start,
            inter_token=timing.gaps,
            num_prompt_tokens=len(self.prompts[index]),
            num_generation_tokens=timing.num_tokens,
            times=timing.times,
            n=self.params.n,
            max_tokens=self._max_tokens(index),
        )

    def _max_tokens(self, index: int) -> int | None:
        """The request's max_tokens; unset (chat), the room the context left beside its prompt."""
        if self.params.max_tokens is not None:
            return self.params.max_tokens
        limit = self.services.max_model_len
        return None if limit is None else limit - len(self.prompts[index])


def _record(timing: _Timing, delta: RequestOutput) -> int:
    """Token arrival times and finish reasons of one delta; returns its number of new tokens."""
    new_tokens = sum(len(c.token_ids) for c in delta.outputs)
    timing.finish_reasons.extend(c.finish_reason for c in delta.outputs if c.finish_reason is not None)
    timing.times.extend(c.times for c in delta.outputs if c.times is not None)
    if not new_tokens:
        return 0
    now = time.perf_counter()
    if timing.first_token is None:
        timing.first_token = now
    elif timing.last_token is not None:  # a delta of several tokens (a stream that caught up): spread the gap
        timing.gaps.extend([(now - timing.last_token) / new_tokens] * new_tokens)
    timing.last_token = now
    timing.num_tokens += new_tokens
    return new_tokens
