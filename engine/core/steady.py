"""A steady engine core: its busy loop on a CPU of its own, few threads, and a garbage collector that
never stops the loop for long.

On a host-bound step (shape S on an H100 is one), where the engine thread runs changes the step's time
by up to 1.6x for a whole run (docs/BENCHMARKS.md, "the spread between runs"): a front end, a loader or
a client landing on the same core, or the thread migrating between cores, slows every step. So the core
process splits the host's CPUs into three sets, chosen once at start (`plan_cpus`):

    loop     the core's busy loop (its main thread): nothing else of the server runs there
    helpers  the core's other threads (ZeroMQ's I/O thread, the CUDA driver's), near the loop but
             never on it; empty on small hosts, where they share `others`
    others   everything else: front-end processes, adapter loaders, tensor-parallel workers

`auto` (the default) picks the two highest-numbered CPUs this process may use on a CUDA host with at
least 8 of them (the loop gets the last one, the helpers the one before), only the loop's on 4-7, and
nothing on fewer or on the CPU device (there the model's own math needs every core). A list (`12,13`,
`12-15`) names the loop's CPU first and the helpers' after it; `off` leaves placement to the kernel.
Where `os.sched_setaffinity` does not exist (not Linux), every plan is None and nothing is pinned.

Linux pins threads, not processes: a thread or process starts with its creator's mask. So the core
process first moves its main thread to `others` (the loaders, tensor-parallel workers and library
threads it starts while loading inherit that), and pins itself to `loop` and its other threads to
`helpers` only when the loop starts (`enter_loop`). A process the loop spawns later (a loader replacing
a dead one) is moved to `others` right after it starts (`move_to_others`).

Threads and garbage: on CUDA the loop's work is Python and launches, so torch's CPU thread pool is cut
to one thread (it would only contend); `enter_loop` collects, then `gc.freeze()`s every object alive
after start-up (the model, the modules, the warm-up's caches), so a full collection never walks them
again, and raises the young generation's threshold so collections come less often.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OFF = "off"
AUTO = "auto"
# The set `others` in the environment, for processes the core starts (they may move there themselves).
OTHERS_ENV = "LORASERVE_OUTSIDE_ENGINE_CPUS"
_MIN_CPUS_TO_PIN = 4  # fewer: pinning the loop would starve the rest
_MIN_CPUS_FOR_HELPERS = 8
# Young-generation threshold (CPython's default is 700): a step allocates thousands of short-lived
# containers; a higher threshold means fewer, still short, collections.
GC_GEN0_THRESHOLD = 10_000


@dataclass(frozen=True)
class CpuPlan:
    """Which CPUs run what (see the module docstring)."""

    loop: frozenset[int]
    helpers: frozenset[int]
    others: frozenset[int]

    def describe(self) -> str:
        helpers = f"CPU {format_cpus(self.helpers)}" if self.helpers else "the rest"
        return (
            f"engine loop on CPU {format_cpus(self.loop)}; its other threads on {helpers}; the rest "
            f"(front ends, loaders) on CPU {format_cpus(self.others)}"
        )


def affinity_supported() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def plan_cpus(spec: str, *, cuda: bool, available: set[int] | None = None) -> CpuPlan | None:
    """The plan for `spec` (auto, off, or a CPU list), or None for no pinning; ValueError for a bad list."""
    spec = (spec or AUTO).strip().lower()
    if spec == OFF or not affinity_supported():
        return None
    cpus = set(available if available is not None else os.sched_getaffinity(0))
    if spec == AUTO:
        if not cuda or len(cpus) < _MIN_CPUS_TO_PIN:
            return None
        ordered = sorted(cpus)
        loop = frozenset(ordered[-1:])
        helpers = frozenset(ordered[-2:-1]) if len(cpus) >= _MIN_CPUS_FOR_HELPERS else frozenset()
        return CpuPlan(loop, helpers, frozenset(cpus - loop - helpers))
    listed = parse_cpus(spec)
    missing = [cpu for cpu in listed if cpu not in cpus]
    if missing:
        raise ValueError(
            f"CPU {missing[0]} is not one this process may use ({format_cpus(cpus)}); "
            "name CPUs from that set, or auto / off"
        )
    others = cpus - set(listed)
    if not others:
        raise ValueError(
            f"{spec!r} leaves no CPU for the front ends and loaders; leave at least one out, or use auto / off"
        )
    return CpuPlan(frozenset(listed[:1]), frozenset(listed[1:]), frozenset(others))


def parse_cpus(spec: str) -> list[int]:
    """'12,13' or '12-15' or '3,8-9' -> CPU numbers in the order given (no repeats)."""
    cpus: list[int] = []
    for part in spec.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(
                f"{spec!r} is not a CPU list: use auto, off, or numbers like 14,15 or 12-15"
            ) from None
        if low < 0 or high < low:
            raise ValueError(f"{part!r} in {spec!r} is not a CPU range (low-high, low <= high)")
        cpus.extend(cpu for cpu in range(low, high + 1) if cpu not in cpus)
    if not cpus:
        raise ValueError(f"{spec!r} names no CPU")
    return cpus


def format_cpus(cpus) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def pin_process(cpus: frozenset[int]) -> None:
    """Move every thread of this process to `cpus` (threads it starts later inherit the mask)."""
    for tid in _thread_ids():
        _set(tid, cpus)


def move_to_others(pid: int) -> None:
    """A process the core just started leaves the loop's CPU for `others` (no-op without a plan)."""
    raw = os.environ.get(OTHERS_ENV)
    if raw and affinity_supported():
        _set(pid, frozenset(parse_cpus(raw)))


def enter_core(plan: CpuPlan | None) -> None:
    """At the core process's start, before anything loads: run on `others` until the loop starts."""
    if plan is None:
        return
    os.environ[OTHERS_ENV] = format_cpus(plan.others)
    pin_process(plan.others)


def enter_loop(plan: CpuPlan | None, *, cuda: bool) -> None:
    """Right before the busy loop (on its thread): pin it, move the process's other threads, quiet the
    interpreter. Safe where affinity is unsupported (only the thread and garbage settings apply)."""
    set_cpu_threads(cuda=cuda, plan=plan)
    if plan is not None:
        main = threading.get_native_id()
        for tid in _thread_ids():
            if tid != main:
                _set(tid, plan.helpers or plan.others)
        _set(main, plan.loop)
        logger.info("CPU placement: %s", plan.describe())
    freeze_garbage()


def set_cpu_threads(*, cuda: bool, plan: CpuPlan | None = None) -> None:
    """torch's CPU threads: one on CUDA (the host's work is Python and launches); on the CPU device the
    model's math needs them: as many as the loop may use when pinned, else torch's default."""
    try:
        import torch
    except ImportError:  # a front end without torch
        return
    if cuda:
        torch.set_num_threads(1)
    elif plan is not None:
        torch.set_num_threads(len(plan.loop | plan.helpers))


def freeze_garbage() -> None:
    """Collect once, move every object alive now out of the collector's sight, collect young objects
    less often (see the module docstring)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def _set(tid: int, cpus: frozenset[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError as exc:  # a thread that just ended, or CPUs a container does not grant
        logger.debug("could not pin thread %d to %s: %s", tid, format_cpus(cpus), exc)


def _thread_ids() -> list[int]:
    try:
        return [int(entry.name) for entry in Path("/proc/self/task").iterdir()]
    except OSError:
        return [0]  # no /proc: the calling thread only
