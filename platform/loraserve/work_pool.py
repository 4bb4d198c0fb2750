"""A few threads of the server's own for a request's CPU work: tokenizing, chat templates, decoding, spec checks.

None of it may run on the event loop: while a handler tokenizes a long prompt there, `/health`, the
metrics listener and every other tenant's stream wait (a 15 MiB prompt froze them for over 8 s).
The pool is not asyncio's default executor, which store and config calls share, so a burst of
tokenizing never delays those, and its size (`--tokenizer-pool-size`) bounds how many cores such work
takes from the rest; jobs beyond it queue. What a job may cost is bounded before it is queued (the body
size limit, the message count, the context length; see inference/prompts.py).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
DEFAULT_POOL_SIZE = 2


class WorkPool:
    def __init__(self, num_threads: int = DEFAULT_POOL_SIZE) -> None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"the work pool needs at least one thread (got {num_threads!r})")
        self.num_threads = num_threads
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="loraserve-work")

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a pool thread; its exception, if any, is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Drop queued jobs; running ones finish on their own (a thread cannot be stopped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
