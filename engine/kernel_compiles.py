"""Counts Triton kernel compilations in this process, so a server can show that none happen once it is ready.

Triton compiles a kernel variant the first time a launch's specialisation key misses its in-process cache:
new constexpr values, an int argument newly equal to 1 or divisible by 16, a pointer newly misaligned.
Whether the binary then comes from the on-disk cache or from the compiler, the launch waited for it.
Triton calls `knobs.runtime.jit_cache_hook` just before each such compile and `jit_post_compile_hook` just
after, once per miss; the interpreter (TRITON_INTERPRET=1) compiles nothing and calls neither.

Those hooks are process-global, so the counter is too: `install()` returns the one counter, chaining any
hook someone else set before. Engines read `num_compiles` and keep their own baseline (LLMEngine.mark_ready).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

# Names of the latest compiles, for the log and for tests that say which kernel compiled.
RECENT = 32


class CompileCounter:
    """Compiles seen through Triton's JIT hooks (or fed to `before`/`after` by a test)."""

    def __init__(self) -> None:
        self.num_compiles = 0
        self.compile_seconds = 0.0  # summed over compiles (includes loading from Triton's disk cache)
        self.recent: deque[str] = deque(maxlen=RECENT)  # kernel names, newest last
        self.warn = False  # set once an engine is ready: every later compile is logged as a warning
        self._started = threading.local()
        self._previous_before = None
        self._previous_after = None

    def before(self, **kwargs) -> bool | None:
        """Triton's jit_cache_hook: a compile starts. Returning True would skip it, so never do."""
        self._started.at = time.perf_counter()
        if self._previous_before is not None:
            return self._previous_before(**kwargs)
        return None

    def after(self, **kwargs) -> None:
        """Triton's jit_post_compile_hook: one kernel variant was compiled (or loaded from disk)."""
        started = getattr(self._started, "at", None)
        seconds = time.perf_counter() - started if started is not None else 0.0
        self._started.at = None
        self.num_compiles += 1
        self.compile_seconds += seconds
        name = _kernel_name(kwargs)
        self.recent.append(name)
        log = logger.warning if self.warn else logger.debug
        log("Triton compiled %s in %.2f s (%d compiles in this process)", name, seconds, self.num_compiles)
        if self._previous_after is not None:
            self._previous_after(**kwargs)


def _kernel_name(kwargs: dict) -> str:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) if fn is not None else None
    return name or str(kwargs.get("key", "?"))


_counter: CompileCounter | None = None
_install_lock = threading.Lock()


def install() -> CompileCounter:
    """Hook the process-wide counter into Triton (once) and return it."""
    global _counter
    with _install_lock:
        if _counter is None:
            counter = CompileCounter()
            try:
                from triton import knobs
            except ImportError:  # a Triton without knobs (< 3.4): nothing to count
                _counter = counter
                return counter
            runtime = knobs.runtime
            counter._previous_before = runtime.jit_cache_hook
            counter._previous_after = runtime.jit_post_compile_hook
            runtime.jit_cache_hook = counter.before
            runtime.jit_post_compile_hook = counter.after
            _counter = counter
        return _counter
