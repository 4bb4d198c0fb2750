"""A steady engine core: which CPUs the plan gives the loop, its helpers and everything else; that a core
process pins its loop thread there and its other threads elsewhere; torch threads and the collector."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from engine.core import steady
from engine.core.steady import CpuPlan, parse_cpus, plan_cpus

pytestmark = pytest.mark.skipif(not steady.affinity_supported(), reason="needs os.sched_setaffinity")


@pytest.mark.parametrize(
    ("spec", "cuda", "cpus", "expected"),
    [
        ("auto", True, range(16), ({15}, {14}, set(range(14)))),
        ("auto", True, range(6), ({5}, set(), set(range(5)))),  # 4-7 CPUs: the loop only
        ("auto", True, range(3), None),  # too few to give one away
        ("auto", False, range(16), None),  # the CPU device: the model's math needs every core
        ("off", True, range(16), None),
        ("14,15", True, range(16), ({14}, {15}, set(range(14)))),
        ("3", False, range(4), ({3}, set(), {0, 1, 2})),  # named: pinned on any device
        ("12-13,2", True, range(16), ({12}, {13, 2}, set(range(16)) - {12, 13, 2})),
    ],
)
def test_plans(spec, cuda, cpus, expected):
    plan = plan_cpus(spec, cuda=cuda, available=set(cpus))
    if expected is None:
        assert plan is None
    else:
        assert (set(plan.loop), set(plan.helpers), set(plan.others)) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("99", "not one this process may use"),
        ("0-3", "leaves no CPU"),
        ("a,b", "not a CPU list"),
        ("5-2", "not a CPU range"),
    ],
)
def test_bad_plans_say_why(spec, message):
    with pytest.raises(ValueError, match=message):
        plan_cpus(spec, cuda=True, available={0, 1, 2, 3})


def test_cpu_lists_keep_their_order():
    assert parse_cpus("7,3-4,3") == [7, 3, 4]


def _core_like(plan: CpuPlan, results) -> None:
    """What the core process does: others until the loop starts, then the loop on its CPU."""
    steady.enter_core(plan)
    started = threading.Event()
    stop = threading.Event()
    seen = {}

    def helper() -> None:  # a library thread started while loading (ZeroMQ's I/O thread, say)
        seen["before"] = os.sched_getaffinity(0)
        started.set()
        stop.wait(30)
        seen["after"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=helper)
    thread.start()
    started.wait(30)
    steady.enter_loop(plan, cuda=True)
    stop.set()
    thread.join(30)
    import gc

    import torch

    results.put(
        {
            "loop": os.sched_getaffinity(0),
            "helper_before": seen["before"],
            "helper_after": seen["after"],
            "env": os.environ.get(steady.OTHERS_ENV),
            "threads": torch.get_num_threads(),
            "gen0": gc.get_threshold()[0],
            "frozen": gc.get_freeze_count() > 0,
        }
    )


def test_a_core_process_pins_its_loop_and_moves_its_other_threads():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    plan = CpuPlan(frozenset(cpus[-1:]), frozenset(), frozenset(cpus[:-1]))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_core_like, args=(plan, results))
    process.start()
    try:
        seen = results.get(timeout=120)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert seen["loop"] == set(plan.loop)
    assert seen["helper_before"] == set(plan.others) == seen["helper_after"]  # never on the loop's CPU
    assert seen["env"] == ",".join(map(str, sorted(plan.others)))
    assert seen["threads"] == 1 and seen["gen0"] == steady.GC_GEN0_THRESHOLD and seen["frozen"]
