"""How many front-end processes, and which CPUs the engine core's loop gets (docs/OPERATIONS.md).

A front-end process is one event loop (HTTP, tokenizing, detokenizing, SSE) and saturates one CPU under
heavy streaming; the engine core needs a CPU of its own for its loop and one for its other threads
(engine.core.steady), and the host also runs adapter loaders (and, in benchmarks, the clients). So by
default: one front end on the CPU device (the model's math needs the cores) or on hosts of fewer than
10 CPUs, else one per 3 CPUs left after 4, up to 4. `--api-server-count` overrides it.

    CPUs   2   4   8   10   13   16   32
    N      1   1   1    2    3    4    4
"""

from __future__ import annotations

import os

from engine.core.steady import CpuPlan, plan_cpus
from loraserve.settings import ServerSettings

MAX_DEFAULT_API_SERVERS = 4


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_api_server_count(num_cpus: int, cuda: bool) -> int:
    if not cuda:
        return 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, (num_cpus - 4) // 3))


def uses_cuda(settings: ServerSettings) -> bool:
    if settings.device != "auto":
        return settings.device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def api_server_count(settings: ServerSettings) -> int:
    if settings.api_server_count is not None:
        return settings.api_server_count
    return default_api_server_count(available_cpus(), uses_cuda(settings))


def cpu_plan(settings: ServerSettings) -> CpuPlan | None:
    """The engine core's CPU plan for these settings (None: no pinning); SystemExit on a bad list."""
    try:
        return plan_cpus(settings.engine_core_cpus, cuda=uses_cuda(settings))
    except ValueError as exc:
        raise SystemExit(f"--engine-core-cpus: {exc}") from None
