"""Grammars compiled off the engine's step loop: a few threads of their own, once per spec, kept for reuse.

Compiling a spec (its budget checked first: budget.py) can take seconds; on the step loop it stalled every
running request. Here a request's spec is handed to `num_threads` compile threads (xgrammar releases
the GIL while it compiles) and the request waits in the scheduler, as one whose adapter is loading
does, while the loop keeps stepping the others; vLLM's engine core does the same (WAITING_FOR_FSM).
Requests asking for the same spec (n > 1 siblings, or any tenant's: a spec is only text) share one
compile; compiled grammars stay in an LRU bounded in bytes (`cache_bytes`), and specs that failed or
ran out of time stay too, so asking again fails at once instead of taking a thread again.

A compile still running `timeout_s` after it started is given up: its requests fail with
SpecTooComplex. The thread cannot be stopped and finishes on its own; its result is dropped. The
shape limits of budget.py keep such compiles rare and short.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output.budget import SpecTooComplex, StructuredOutputError
from engine.structured_output.grammars import GrammarCompiler
from engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_THREADS = 2
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 512 << 20  # vLLM's VLLM_XGRAMMAR_CACHE_MB default
MAX_CACHED_SPECS = 4096  # entries, failures included (each holds its spec text)
SpecKey = tuple[str, str]  # (kind, spec text)


@dataclass(eq=False)
class Compilation:
    """One spec's compile: its future (a compiled grammar or a StructuredOutputError) and when it began."""

    key: SpecKey
    future: Future = field(default_factory=Future)
    started: float | None = None  # time.monotonic() when a compile thread took it (set by that thread)

    @property
    def size_bytes(self) -> int:
        if not self.future.done() or self.future.exception() is not None:
            return len(self.key[1])
        return self.future.result().memory_size_bytes + len(self.key[1])


class GrammarCompilePool:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        num_threads: int = DEFAULT_COMPILE_THREADS,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.timeout_s = timeout_s
        self._cache_bytes = cache_bytes
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile")
        self._compiler: GrammarCompiler | None = None  # built by the first compile (reads the vocabulary)
        self._compiler_lock = threading.Lock()
        # Engine thread only (compile threads touch nothing but their Compilation's future and start time).
        self._cache: OrderedDict[SpecKey, Compilation] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Compilation:
        """The compile of this spec: a cached one (done or running) or a new one."""
        key = (params.kind, params.spec_text or "")
        known = self._cache.get(key)
        if known is not None:
            self._cache.move_to_end(key)
            return known
        compilation = Compilation(key)
        self._executor.submit(self._compile, compilation, params)
        self._cache[key] = compilation
        self._evict()
        return compilation

    def expired(self, compilation: Compilation, now: float) -> bool:
        started = compilation.started
        return not compilation.future.done() and started is not None and now - started > self.timeout_s

    def give_up(self, compilation: Compilation) -> SpecTooComplex:
        """A compile past its time: later asks for the spec fail at once; the thread's result is dropped."""
        error = SpecTooComplex(
            f"compiling this structured output took longer than {self.timeout_s:g} s; simplify the schema, "
            "regex or grammar"
        )
        failed = Compilation(compilation.key, started=compilation.started)
        failed.future.set_exception(error)
        self._cache[compilation.key] = failed
        logger.warning("gave up a grammar compile after %.0f s (%s spec)", self.timeout_s, compilation.key[0])
        return error

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- compile threads --------------------------------------------------------------------------

    def _compile(self, compilation: Compilation, params: StructuredOutputsParams) -> None:
        try:
            compiler = self._grammar_compiler()
            compilation.started = time.monotonic()  # the budget is the spec's: not the compiler's first build
            compiled = compiler.compile(params)
        except StructuredOutputError as exc:
            compilation.future.set_exception(exc)
        except Exception as exc:  # a compiler failure on this spec still fails only its requests
            logger.exception("compiling a %s spec failed", params.kind)
            compilation.future.set_exception(
                StructuredOutputError(f"the structured output cannot be compiled: {exc}")
            )
        else:
            compilation.future.set_result(compiled)

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                # xgrammar's own cache stays off: this pool's LRU is the one place compiled grammars live
                self._compiler = GrammarCompiler(
                    self._tokenizer, self._vocab_size, self._stop_token_ids, cache_enabled=False
                )
            return self._compiler

    def _evict(self) -> None:
        """Least recently used done entries go first, beyond the byte budget or the entry cap."""
        total = sum(c.size_bytes for c in self._cache.values())
        for key, compilation in list(self._cache.items()):
            if total <= self._cache_bytes and len(self._cache) <= MAX_CACHED_SPECS:
                return
            if compilation.future.done():
                total -= compilation.size_bytes
                del self._cache[key]
