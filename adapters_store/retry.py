"""Whole-operation retries with exponential backoff and full jitter.

Why not botocore's own retries: they cover one HTTP request, not a download whose body breaks
halfway (the response was already handed over), and their backoff cannot be configured. So the S3
client makes one attempt per call and every retry happens here, in one place, with one policy;
botocore still supplies the connection pool, timeouts and error types.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from adapters_store.errors import StoreUnavailable
from adapters_store.metrics import StoreMetrics

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    retries: int  # extra attempts after the first
    backoff_s: float  # the first wait is at most this
    max_backoff_s: float  # no wait exceeds this
    deadline_s: float = float("inf")  # no retry starts later than this after the first attempt


def backoff_delay(attempt: int, policy: RetryPolicy, rand: Callable[[], float] = random.random) -> float:
    """Full jitter: uniform in [0, min(max_backoff, backoff * 2**attempt)] for retry `attempt` (0-based).

    Random waits spread the retries of many replicas hit by one outage, instead of synchronising them.
    """
    return rand() * min(policy.max_backoff_s, policy.backoff_s * (2**attempt))


def call_with_retries(
    operation: str,
    fn: Callable[[], T],
    policy: RetryPolicy,
    is_retryable: Callable[[BaseException], bool],
    describe: Callable[[BaseException], str],
    metrics: StoreMetrics,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run fn; on a retryable error wait and run it again; StoreUnavailable once retries run out.

    Errors that retrying cannot fix (not found, access denied, a failed precondition) propagate
    unchanged at once, for the caller to translate.
    """
    started = time.monotonic()
    for attempt in range(policy.retries + 1):
        try:
            return fn()
        except Exception as exc:
            if not is_retryable(exc):
                raise
            reason = describe(exc)
            delay = backoff_delay(attempt, policy)
            if attempt == policy.retries or time.monotonic() + delay - started > policy.deadline_s:
                raise StoreUnavailable(
                    f"{operation} failed after {attempt + 1} attempts: {reason}; check that the adapter store "
                    "is reachable and healthy (retries and timeouts are set in StoreConfig)",
                    reason,
                ) from exc
            metrics.retry(operation, reason)
            sleep(delay)
    raise AssertionError("unreachable")
