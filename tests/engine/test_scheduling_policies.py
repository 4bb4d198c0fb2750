"""Scheduling policies (engine/scheduling_policies/): each one's waiting order and preemption choices,
through the scheduler and on its own; the registry; `priority` end to end through the engine."""

from __future__ import annotations

import itertools
import random

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core.request_checks import RequestError
from engine.engine_args import SCHEDULING_POLICIES
from engine.fairness import VirtualTokenCounters
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.request_meta import RequestMeta, with_priority
from engine.scheduler import Scheduler
from engine.scheduling_policies import POLICIES, SchedulingPolicy, make_policy

BLOCK_SIZE = 4
_ids = itertools.count()
_clock = itertools.count(1)


def make_scheduler(policy, *, num_blocks=64, max_model_len=64, **config):
    config = EngineConfig(
        model="test",
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=False,
        scheduling_policy=policy,
        **config,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, False), max_model_len)


def make_request(name, num_prompt_tokens=4, max_tokens=8, *, priority=0, tenant="default"):
    """Arrival times strictly increase in creation order (a fake clock, so ties are decided by it)."""
    request = Request(
        f"{name}-{next(_ids)}",
        list(range(10, 10 + num_prompt_tokens)),
        SamplingParams(max_tokens=max_tokens),
        meta=RequestMeta(priority=priority, tenant=tenant),
    )
    request.arrival_time = float(next(_clock))
    return request


def step(scheduler):
    """One engine step: schedule, sample one token for requests that finished their known tokens."""
    output = scheduler.schedule()
    for item in output.scheduled:
        if item.samples:
            item.request.append_output_token(7)
            if item.request.num_output_tokens >= item.request.sampling_params.max_tokens:
                scheduler.finish_request(item.request.request_id, RequestStatus.FINISHED_LENGTH)
    return output


def names(requests):
    return [r.request_id.split("-")[0] for r in requests]


# -- the registry -----------------------------------------------------------------------------------


def test_every_configurable_policy_is_registered_and_builds():
    assert set(POLICIES) == set(SCHEDULING_POLICIES)
    for name in SCHEDULING_POLICIES:
        policy = make_policy(EngineConfig(model="t", scheduling_policy=name), VirtualTokenCounters())
        assert isinstance(policy, POLICIES[name]) and isinstance(policy, SchedulingPolicy)
    assert [n for n in SCHEDULING_POLICIES if POLICIES[n].uses_priority] == ["priority"]


# -- waiting order ----------------------------------------------------------------------------------


def test_fcfs_orders_by_arrival_whatever_the_tenant_or_priority():
    scheduler = make_scheduler("fcfs")
    for request in [make_request("a", tenant="x"), make_request("b", tenant="y"), make_request("c")]:
        scheduler.add_request(request)
    assert names(scheduler.waiting) == ["a", "b", "c"]


def test_fair_takes_the_tenant_with_the_lowest_counter_first_round_robin():
    scheduler = make_scheduler("fair")
    for name, tenant in [("x1", "x"), ("x2", "x"), ("y1", "y"), ("y2", "y")]:
        scheduler.add_request(make_request(name, tenant=tenant))
    scheduler.counters.charge("x", num_prompt_tokens=100)
    assert names(scheduler.waiting) == ["y1", "x1", "y2", "x2"]


def test_priority_orders_by_priority_then_arrival():
    scheduler = make_scheduler("priority")
    for name, priority in [("a", 1), ("b", 0), ("c", 2), ("d", 0), ("e", -3), ("f", 1)]:
        scheduler.add_request(make_request(name, priority=priority))
    assert names(scheduler.waiting) == ["e", "b", "d", "a", "f", "c"]


def test_priority_admits_the_best_first_when_seats_are_short():
    scheduler = make_scheduler("priority", max_num_seqs=2)
    for name, priority in [("low1", 5), ("low2", 5), ("high", 0), ("mid", 2)]:
        scheduler.add_request(make_request(name, priority=priority))
    assert names(step(scheduler).newly_admitted) == ["high", "mid"]
    fcfs = make_scheduler("fcfs", max_num_seqs=2)
    for name, priority in [("low1", 0), ("low2", 0), ("high", 0), ("mid", 0)]:
        fcfs.add_request(make_request(name, priority=priority))
    assert names(step(fcfs).newly_admitted) == ["low1", "low2"]


def test_a_preempted_priority_request_goes_back_by_arrival_within_its_priority():
    policy = make_policy(EngineConfig(model="t", scheduling_policy="priority"), VirtualTokenCounters())
    scheduler = make_scheduler("priority")
    first, second, third = (make_request(n, priority=1) for n in ("first", "second", "third"))
    queue = []
    for request in (first, third):
        queue.insert(policy.position(queue, request, front=False), request)
    queue.insert(policy.position(queue, second, front=True), second)  # preempted: back by its arrival
    assert queue == [first, second, third]
    assert scheduler.policy.queue_key(first) == 1


# -- preemption when KV blocks run out --------------------------------------------------------------


def test_each_policy_picks_its_kv_victim():
    running = [
        make_request("old-low", priority=3, tenant="x"),
        make_request("mid", priority=1, tenant="y"),
        make_request("new-low", priority=3, tenant="y"),
        make_request("newest", priority=0, tenant="y"),
    ]
    fcfs, fair, priority = (
        make_policy(EngineConfig(model="t", scheduling_policy=name), VirtualTokenCounters())
        for name in ("fcfs", "fair", "priority")
    )
    fair.counters.charge("x", num_prompt_tokens=10)
    assert fcfs.pick_victim(running).request_id.startswith("newest")
    assert fair.pick_victim(running).request_id.startswith("old-low")  # x: the highest counter
    assert priority.pick_victim(running).request_id.startswith("new-low")  # worst, then latest


def test_priority_preempts_the_worst_running_request_when_blocks_run_out():
    """The worst priority was admitted first (it arrived alone), so it is not the newest: fcfs would
    take the newest, priority takes the worst."""
    scheduler = make_scheduler("priority", num_blocks=8, max_model_len=32)
    worst = make_request("worst", 8, 12, priority=2)
    scheduler.add_request(worst)
    step(scheduler)
    for name, priority in [("best", 0), ("mid", 1)]:
        scheduler.add_request(make_request(name, 8, 12, priority=priority))
    preempted = []
    for _ in range(12):
        preempted += step(scheduler).preempted
        if preempted:
            break
    assert names(scheduler.running) == ["best", "mid"]
    assert preempted == [worst] and worst.status is RequestStatus.PREEMPTED


# -- a waiting request preempts for a row or blocks -------------------------------------------------


def test_a_better_priority_arrival_preempts_the_worst_running_request_for_a_seat():
    scheduler = make_scheduler("priority", max_num_seqs=2)
    low, mid = make_request("low", priority=5), make_request("mid", priority=2)
    scheduler.add_request(low)
    scheduler.add_request(mid)
    step(scheduler)
    same = make_request("same", priority=2)  # equal to the best running one's: never preempts
    scheduler.add_request(same)
    output = step(scheduler)
    assert output.preempted == [low] and names(output.newly_admitted) == ["same"]
    equal = make_request("equal", priority=2)
    scheduler.add_request(equal)
    output = step(scheduler)
    assert output.preempted == [] and output.newly_admitted == []
    assert names(scheduler.waiting) == ["equal", "low"]  # priority 2 before the preempted priority 5
    assert scheduler.num_admission_preemptions == 1 == scheduler.num_preemptions


def test_priority_preempts_only_strictly_worse_requests_and_only_if_they_free_enough():
    scheduler = make_scheduler("priority", num_blocks=6, max_model_len=24)
    a, b = make_request("a", 8, 4, priority=1), make_request("b", 8, 4, priority=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)  # 4 of 6 blocks taken
    kv, policy = scheduler.kv_cache_manager, scheduler.policy
    taker = make_request("taker", 12, 4, priority=0)
    pick = policy.pick_victims
    assert pick(taker, [a, b], [], kv, need_row=False, num_missing_blocks=2) == [b]
    assert pick(taker, [a, b], [], kv, need_row=False, num_missing_blocks=4) == [b, a]
    assert pick(taker, [a, b], [], kv, need_row=False, num_missing_blocks=5) == []  # cannot be had
    assert pick(taker, [a, b], [b], kv, need_row=True, num_missing_blocks=0) == [a]  # b admitted now
    tie = make_request("tie", 12, 4, priority=1)
    assert pick(tie, [a, b], [], kv, need_row=False, num_missing_blocks=4) == []  # a is not worse
    fcfs = make_policy(EngineConfig(model="t", scheduling_policy="fcfs"), VirtualTokenCounters())
    assert fcfs.pick_victims(taker, [a, b], [], kv, need_row=True, num_missing_blocks=4) == []  # never


@pytest.mark.parametrize("seed", range(3))
def test_random_priority_workloads_finish_with_every_block_accounted_for(seed):
    """Tight rows, blocks and budget, priorities mixed, arrivals over time: every request finishes;
    the blocks running requests hold plus the free ones are always the whole cache."""
    rng = random.Random(seed)
    scheduler = make_scheduler(
        "priority", num_blocks=12, max_model_len=32, max_num_seqs=3, max_num_batched_tokens=32
    )
    kv = scheduler.kv_cache_manager
    pending = [
        make_request(f"r{i}", rng.randint(1, 10), rng.randint(1, 6), priority=rng.randint(0, 3))
        for i in range(30)
    ]
    for _ in range(2000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                scheduler.add_request(pending.pop(0))
        step(scheduler)
        held = sum(len(kv.get_block_ids(r.request_id)) for r in scheduler.running)
        assert held + kv.block_pool.num_free_blocks == 12
        if not pending and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests() and not pending


# -- end to end through the engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def priority_llm(text_model_dir):
    from engine import LLM

    return LLM(
        model=str(text_model_dir),
        max_model_len=64,
        block_size=4,
        max_num_seqs=1,
        scheduling_policy="priority",
    )


def test_a_high_priority_request_runs_before_earlier_low_priority_ones(priority_llm):
    """One seat: the best priority is served first, a running worse one is preempted for it and then
    resumes with the very tokens it would have produced alone (greedy)."""
    engine = priority_llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    alone = priority_llm.generate(["one", "two", "three"], params)
    engine.add_request("low-1", "one", params, priority=5)
    engine.step()  # low-1 takes the seat
    engine.add_request("low-2", "two", params, priority=5)
    engine.add_request("high", "three", params, priority=0)
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                order.append(output.request_id)
                tokens[output.request_id] = output.outputs[0].token_ids
    assert order == ["high", "low-1", "low-2"]
    assert engine.scheduler.num_admission_preemptions >= 1
    assert [tokens["low-1"], tokens["low-2"], tokens["high"]] == [o.outputs[0].token_ids for o in alone]
    # The same through LLM.generate's vLLM argument: one output per prompt, in the prompts' order.
    again = priority_llm.generate(["one", "two", "three"], params, priority=[3, 2, 1])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in alone]


def test_a_non_zero_priority_is_refused_under_another_policy(mixed_llm):
    params = SamplingParams(max_tokens=1)
    with pytest.raises(RequestError, match="'priority' scheduling policy.*'fair'"):
        mixed_llm.generate(["a", "b"], params, priority=[0, 1])
    with pytest.raises(RequestError, match="priority"):
        mixed_llm.engine.add_request("refused", "a", params, meta=RequestMeta(priority=-1))
    assert not mixed_llm.engine.has_unfinished_requests()  # nothing of either was queued
    assert len(mixed_llm.generate(["a"], params, priority=[0])) == 1  # 0 is everyone's default
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        mixed_llm.generate(["a", "b"], params, priority=[0])
    with pytest.raises(ValueError, match="priority given twice"):
        mixed_llm.engine.add_request("twice", "a", params, meta=RequestMeta(priority=1), priority=2)


def test_vllms_priority_argument_folds_into_the_meta():
    """AsyncLLM.generate and LLMEngine.add_request take vLLM's `priority=` beside `meta`."""
    acme = RequestMeta(tenant="acme", tenant_weight=2.0, cache_salt="s")
    assert with_priority(None, 0) == RequestMeta()
    assert with_priority(acme, 0) is acme
    assert with_priority(acme, -7) == RequestMeta(
        tenant="acme", tenant_weight=2.0, cache_salt="s", priority=-7
    )
    assert with_priority(RequestMeta(priority=3), 3).priority == 3
    with pytest.raises(ValueError, match="priority given twice"):
        with_priority(RequestMeta(priority=3), 4)
    for bad in (1.5, True, "1"):
        with pytest.raises(ValueError, match="priority must be an integer"):
            with_priority(None, bad)
