"""The fair policy: virtual token counters by tenant, the VTC service bound, work conservation, preemption.

The service a tenant receives is recomputed here from the scheduler's outputs (prompt tokens when a
request is first admitted, one output token per sampling step), independently of its counters.
"""

import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from engine.config import EngineConfig
from engine.fairness import VirtualTokenCounters, service_bound
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.request_meta import RequestMeta
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tenant_usage import SHARE_WINDOW_S, TenantLedger

BLOCK_SIZE = 4
PROMPT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0


def make_scheduler(*, num_blocks=64, max_model_len=64, adapter_ready=lambda adapter_id: True, **config):
    config = EngineConfig(
        model="test", block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, enable_prefix_caching=False, **config
    )
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, False), max_model_len, adapter_ready)


_ids = itertools.count()


def make_request(tenant, num_prompt_tokens, max_tokens=8, weight=1.0, adapter_id=None, arrival=None):
    request = Request(
        f"{tenant}-{next(_ids)}",
        list(range(num_prompt_tokens)),
        SamplingParams(max_tokens=max_tokens),
        adapter_id=adapter_id,
        meta=RequestMeta(tenant=tenant, tenant_weight=weight),
    )
    if arrival is not None:
        request.arrival_time = arrival
    return request


@dataclass
class Trace:
    """Per step: the weighted service of each tenant and who was backlogged all through the step."""

    service: list[dict[str, float]] = field(default_factory=list)
    backlogged: list[set[str]] = field(default_factory=list)
    outputs: list = field(default_factory=list)


def run(scheduler, arrivals, num_steps):
    """Drive the scheduler like the engine does; arrivals: step -> requests added before that step."""
    trace, admitted = Trace(), set()
    for step in range(num_steps):
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        before = {r.meta.tenant for r in scheduler.waiting}
        output = scheduler.schedule()
        service: dict[str, float] = {}
        for request in output.newly_admitted:
            if request.request_id not in admitted:
                admitted.add(request.request_id)
                service[request.meta.tenant] = (
                    service.get(request.meta.tenant, 0.0) + PROMPT_WEIGHT * request.num_prompt_tokens
                )
        for item in output.scheduled:
            if item.samples:
                request = item.request
                service[request.meta.tenant] = service.get(request.meta.tenant, 0.0) + OUTPUT_WEIGHT
                request.append_output_token(7)
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        trace.service.append(service)
        trace.backlogged.append(before & {r.meta.tenant for r in scheduler.waiting})
        trace.outputs.append(output)
    return trace


def worst_gap(trace, weights):
    """max over tenant pairs and intervals in which both stay backlogged of |S_f/w_f - S_g/w_g|."""
    worst = 0.0
    for f, g in itertools.combinations(sorted(weights), 2):
        low = high = gap = 0.0
        for service, backlogged in zip(trace.service, trace.backlogged):
            if not {f, g} <= backlogged:
                low = high = gap = 0.0  # the interval restarts at the next joint backlog
                continue
            gap += service.get(f, 0.0) / weights[f] - service.get(g, 0.0) / weights[g]
            low, high = min(low, gap), max(high, gap)
            worst = max(worst, high - low)
    return worst


def flood(tenant, count, prompt, max_tokens, weight=1.0, step=0):
    return {step: [make_request(tenant, prompt, max_tokens, weight) for _ in range(count)]}


def merge(*arrival_maps):
    merged: dict[int, list] = {}
    for arrivals in arrival_maps:
        for step, requests in arrivals.items():
            merged.setdefault(step, []).extend(requests)
    return merged


def steady(tenant, every, until, prompt, max_tokens, weight=1.0, start=0):
    return {s: [make_request(tenant, prompt, max_tokens, weight)] for s in range(start, until, every)}


NUM_BLOCKS, MAX_BATCHED, MAX_SEQS = 64, 32, 8
# The bound's M: the KV cache holds at most this many tokens of running requests.
MAX_BATCH_TOKENS = NUM_BLOCKS * BLOCK_SIZE

CASES = {
    # name: (weights, arrivals built lazily, longest prompt)
    "two tenants, equal weights, long vs short prompts": (
        {"a": 1.0, "b": 1.0},
        lambda: merge(flood("a", 60, 48, 8), flood("b", 60, 6, 8)),
        48,
    ),
    "two tenants, weights 2:1, same prompts": (
        {"a": 2.0, "b": 1.0},
        lambda: merge(flood("a", 80, 16, 6, weight=2.0), flood("b", 80, 16, 6)),
        16,
    ),
    "two tenants, b arrives steadily while a floods": (
        {"a": 1.0, "b": 1.0},
        lambda: merge(flood("a", 120, 40, 4), steady("b", 2, 300, 8, 12)),
        40,
    ),
    "three tenants, weights 1:2:3, mixed prompts and arrivals": (
        {"a": 1.0, "b": 2.0, "c": 3.0},
        lambda: merge(
            flood("a", 80, 40, 4),
            steady("b", 1, 300, 10, 6, weight=2.0),
            *(flood("c", 6, 20, 10, weight=3.0, step=s) for s in range(0, 300, 25)),
        ),
        40,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_backlogged_tenants_stay_within_the_vtc_bound_at_every_step(name):
    weights, arrivals, longest_prompt = CASES[name]
    scheduler = make_scheduler(
        num_blocks=NUM_BLOCKS, max_num_batched_tokens=MAX_BATCHED, max_num_seqs=MAX_SEQS
    )
    trace = run(scheduler, arrivals(), 300)
    bound = (
        2
        * service_bound(PROMPT_WEIGHT, OUTPUT_WEIGHT, longest_prompt, MAX_BATCH_TOKENS)
        / min(weights.values())
    )
    assert any(len(b) >= 2 for b in trace.backlogged)  # the case does keep tenants backlogged together
    assert worst_gap(trace, weights) <= bound


def test_fcfs_breaks_the_bound_that_fair_keeps():
    """The check above can fail: first come first served lets the flooding tenant take everything."""
    weights, arrivals, longest_prompt = CASES["two tenants, equal weights, long vs short prompts"]
    bound = 2 * service_bound(PROMPT_WEIGHT, OUTPUT_WEIGHT, longest_prompt, MAX_BATCH_TOKENS)
    # a's flood arrives first, so fcfs serves all of it before any of b's.
    fcfs = make_scheduler(max_num_batched_tokens=MAX_BATCHED, max_num_seqs=MAX_SEQS, scheduling_policy="fcfs")
    assert worst_gap(run(fcfs, arrivals(), 300), weights) > bound


def test_weights_split_the_service_in_proportion():
    scheduler = make_scheduler(max_num_batched_tokens=MAX_BATCHED, max_num_seqs=MAX_SEQS)
    arrivals = merge(flood("a", 400, 12, 4, weight=3.0), flood("b", 400, 12, 4))
    trace = run(scheduler, arrivals, 200)
    assert all(backlogged == {"a", "b"} for backlogged in trace.backlogged)
    a = sum(s.get("a", 0.0) for s in trace.service)
    b = sum(s.get("b", 0.0) for s in trace.service)
    assert a / b == pytest.approx(3.0, rel=0.1)


def test_a_returning_tenant_gets_no_burst_beyond_the_bound():
    """c is served once, idles while a and b use the engine, then floods: it is lifted, not owed."""
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    arrivals = merge(
        flood("a", 150, 16, 8), flood("b", 150, 16, 8), flood("c", 1, 16, 8), flood("c", 80, 16, 8, step=150)
    )
    scheduler = make_scheduler(max_num_batched_tokens=MAX_BATCHED, max_num_seqs=MAX_SEQS)
    trace = run(scheduler, arrivals, 300)
    assert all("c" in b for b in trace.backlogged[150:200])
    bound = 2 * service_bound(PROMPT_WEIGHT, OUTPUT_WEIGHT, 16, MAX_BATCH_TOKENS)
    assert worst_gap(trace, weights) <= bound
    # Right after its return c gets about a third of the service, not all of it.
    first = trace.service[150:200]
    c_part = sum(s.get("c", 0.0) for s in first) / sum(sum(s.values()) for s in first)
    assert c_part < 0.5


def test_lift_goes_to_the_lowest_backlogged_counter_or_the_last_to_leave():
    counters = VirtualTokenCounters(1.0, 2.0)
    counters.add_waiting("a", 1.0)
    counters.charge("a", num_prompt_tokens=100)
    counters.add_waiting("b", 1.0)  # a is backlogged at 100: b starts there, not at 0
    assert counters.counter("b") == 100
    counters.charge("b", num_output_tokens=10)  # 120
    counters.remove_waiting("a")
    counters.remove_waiting("b")  # b leaves last, at 120
    counters.add_waiting("c", 1.0)  # nobody backlogged: the last to leave sets the floor
    assert counters.counter("c") == 120
    counters.charge("a", num_prompt_tokens=500)  # a's debt (600) stays when it comes back
    counters.add_waiting("a", 2.0)
    assert counters.counter("a") == 600
    counters.charge("a", num_prompt_tokens=100)  # weight 2: half the counter
    assert counters.counter("a") == 650


def test_an_idle_engine_never_waits_for_fairness_and_budgets_are_used():
    """Work conservation: while anything admissible waits, a step leaves no batch slot or token idle."""
    scheduler = make_scheduler(num_blocks=256, max_model_len=64, max_num_batched_tokens=24, max_num_seqs=6)
    rng = random.Random(1)
    arrivals = {
        step: [
            make_request(rng.choice("abc"), rng.randint(1, 30), rng.randint(1, 6))
            for _ in range(rng.randint(0, 3))
        ]
        for step in range(150)
    }
    for step in range(400):
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        output = scheduler.schedule()
        if scheduler.num_waiting:
            assert output.scheduled  # never an empty step while something waits
            assert scheduler.num_running == 6 or output.num_batched_tokens == 24, (
                f"step {step}: capacity left idle while {scheduler.num_waiting} requests wait"
            )
        for item in output.scheduled:
            if item.samples:
                item.request.append_output_token(7)
                if item.request.num_output_tokens >= item.request.sampling_params.max_tokens:
                    scheduler.finish_request(item.request.request_id, RequestStatus.FINISHED_LENGTH)
    assert not scheduler.has_unfinished_requests()


def test_a_tenant_whose_adapter_is_loading_does_not_stall_the_others():
    loaded: set[str] = set()
    scheduler = make_scheduler(adapter_ready=lambda adapter_id: adapter_id in loaded)
    a = make_request("a", 4, adapter_id="x")  # a's counter is the lowest (0), but x is not ready
    scheduler.add_request(a)
    scheduler.counters.charge("b", num_prompt_tokens=10)
    b = make_request("b", 4)
    scheduler.add_request(b)
    assert scheduler.schedule().newly_admitted == [b]
    loaded.add("x")
    assert scheduler.schedule().newly_admitted == [a]


def test_max_loras_skips_to_the_next_tenant_and_within_a_tenant_keeps_fifo():
    scheduler = make_scheduler(max_loras=1)
    a1, a2 = make_request("a", 4, adapter_id="x", max_tokens=3), make_request("a", 4, adapter_id="y")
    b1 = make_request("b", 4, adapter_id="x")
    for request in (a1, a2, b1):
        scheduler.add_request(request)
    # a1 takes the one slot with x; a2 (y) would be a second adapter: b1 (x) goes instead.
    assert scheduler.schedule().newly_admitted == [a1, b1]
    assert [r.request_id for r in scheduler.waiting] == [a2.request_id]


# fair: a arrives at step 1, is passed over at steps 1-3, then b's running requests (3 steps each) drain.
@pytest.mark.parametrize(("policy", "admitted_by"), [("fair", 1 + 3 + 3 + 1), ("fcfs", None)])
def test_a_request_kept_out_by_other_adapters_is_not_starved(policy, admitted_by):
    """max_loras=1 and b's requests for adapter y keep coming: fcfs never lets a's adapter x in; fair
    passes a's request over for fairness_max_bypass_steps steps, then holds admission until y drains."""
    scheduler = make_scheduler(max_loras=1, scheduling_policy=policy, fairness_max_bypass_steps=3)
    arrivals = {step: [make_request("b", 4, 3, adapter_id="y") for _ in range(2)] for step in range(40)}
    a = make_request("a", 4, 2, adapter_id="x")
    arrivals[1].append(a)
    trace = run(scheduler, arrivals, 40)
    steps = [i for i, output in enumerate(trace.outputs) if a in output.newly_admitted]
    if admitted_by is None:
        assert steps == []
    else:
        assert steps and steps[0] <= admitted_by


def test_a_held_request_drains_one_adapter_while_the_others_keep_admitting():
    """max_loras=2, adapters y and z running with new requests every step, x waiting for a slot. Once
    x's bypasses are spent, one of them (the one closest to done) admits nothing new and the other keeps
    admitting; no newer adapter w takes the slot before x, and x gets the slot when it frees."""
    scheduler = make_scheduler(max_loras=2, fairness_max_bypass_steps=2, max_num_seqs=128, num_blocks=1024)
    arrivals = {0: [make_request("b", 4, 30, adapter_id="y"), make_request("b", 4, 6, adapter_id="z")]}
    x = make_request("a", 4, 2, adapter_id="x")
    arrivals[1] = [x]
    for step in range(1, 60):
        arrivals.setdefault(step, []).extend(
            [make_request("b", 4, 30, adapter_id="y"), make_request("b", 4, 30, adapter_id="z")]
        )
    arrivals[4].append(make_request("c", 4, 2, adapter_id="w"))  # a newer adapter, behind x
    trace = run(scheduler, arrivals, 60)
    admitted = [{r.adapter_id for r in output.newly_admitted} for output in trace.outputs]
    x_step = next(i for i, adapters in enumerate(admitted) if "x" in adapters)
    held = range(1 + 2 + 1, x_step)  # after x's two bypasses, until x runs
    assert x_step <= 1 + 2 + 30 + 1  # the drained adapter's last requests (30 tokens) end, then x
    draining = [a for a in ("y", "z") if not any(a in admitted[i] for i in held)]
    assert len(draining) == 1  # exactly one adapter stops admitting...
    other = ({"y", "z"} - set(draining)).pop()
    assert all(other in admitted[i] for i in held)  # ...and the other keeps admitting every step
    w_step = next(i for i, adapters in enumerate(admitted) if "w" in adapters)
    assert w_step > x_step  # no newer adapter took the slot first


def test_a_head_lacking_blocks_is_passed_over_for_a_bounded_number_of_steps():
    # 16 blocks of 4 tokens. b's long request holds 11 blocks, then grows to 14; a's prompt needs 8.
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=64, fairness_max_bypass_steps=2)
    big_b = make_request("b", 44, max_tokens=12)
    scheduler.add_request(big_b)
    run(scheduler, {}, 1)
    a = make_request("a", 32, max_tokens=1)
    scheduler.add_request(a)  # lifted to b's counter, which then grows with b's decodes: a is the lowest
    admitted_small = []
    for step in range(20):
        small = make_request("b", 1, max_tokens=1)  # one block, freed in the same step
        output = run(scheduler, {0: [small]}, 1).outputs[0]
        if small in output.newly_admitted:
            admitted_small.append(step)
        if a in output.newly_admitted:
            break
    # b's small requests ran while a lacked room, twice; then admission waited for a, and a ran as soon
    # as b's long request freed its blocks.
    assert admitted_small == [0, 1]
    assert a in output.newly_admitted and big_b.is_finished
    assert step == 11


def test_preemption_takes_the_tenant_most_over_its_share_first():
    # 6 blocks; three requests of 2 blocks each fill the cache. "heavy" has the highest counter and the
    # oldest request; fcfs would preempt the newest (light's), fair preempts heavy's.
    scheduler = make_scheduler(num_blocks=6, max_model_len=24)
    heavy = make_request("heavy", 8, max_tokens=4)
    light1, light2 = make_request("light", 8, max_tokens=4), make_request("light", 8, max_tokens=4)
    for request in (heavy, light1, light2):
        scheduler.add_request(request)
    run(scheduler, {}, 1)  # all three admitted: cache full
    assert scheduler.running == [heavy, light1, light2]
    scheduler.counters.charge("heavy", num_prompt_tokens=1000)  # say heavy used far more earlier
    output = run(scheduler, {}, 1).outputs[0]  # each needs a third block: one must go
    assert output.preempted == [heavy]
    assert [s.request for s in output.scheduled] == [light1, light2]

    fcfs = make_scheduler(num_blocks=6, max_model_len=24, scheduling_policy="fcfs")
    requests = [make_request(t, 8, max_tokens=4) for t in ("heavy", "light", "light")]
    for request in requests:
        fcfs.add_request(request)
    run(fcfs, {}, 1)
    fcfs.counters.charge("heavy", num_prompt_tokens=1000)
    assert run(fcfs, {}, 1).outputs[0].preempted == [requests[2]]


def test_counters_charge_prompts_once_and_every_sampled_token():
    scheduler = make_scheduler(max_num_batched_tokens=8, num_blocks=64)
    request = make_request("a", 20, max_tokens=3, weight=2.0)
    scheduler.add_request(request)
    trace = run(scheduler, {}, 8)
    # 20 prompt tokens at admission, 3 sampled tokens; weight 2 halves the counter.
    assert scheduler.counters.counter("a") == pytest.approx((20 * PROMPT_WEIGHT + 3 * OUTPUT_WEIGHT) / 2)
    assert sum(s.get("a", 0.0) for s in trace.service) == 20 + 3 * 2
    (stats,) = scheduler.tenant_stats()
    assert (stats.tenant, stats.num_requests, stats.num_prompt_tokens, stats.num_generation_tokens) == (
        "a",
        1,
        20,
        3,
    )
    assert stats.share == 1.0 and stats.weight == 2.0


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("scheduling_policy", "lottery"),
        ("fairness_prompt_token_weight", 0),
        ("fairness_output_token_weight", -1.0),
        ("fairness_max_bypass_steps", -1),
    ],
)
def test_config_refuses_bad_fairness_settings(setting, value):
    with pytest.raises(ValueError, match=setting):
        EngineConfig(model="test", **{setting: value})


@pytest.mark.parametrize("seed", range(4))
def test_random_multi_tenant_workloads_keep_the_kv_cache_consistent_and_finish(seed):
    """Tight caches: preemption by counter (victims already scheduled this step give their tokens back),
    passing over heads that lack room, adapters and prefix caching; every request finishes, no step is
    empty while something waits, and what the runner would read is what it wrote."""
    rng = random.Random(seed)
    config = EngineConfig(
        model="test",
        block_size=BLOCK_SIZE,
        num_kv_blocks=12,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([4, 8]),
        max_loras=2,
        fairness_max_bypass_steps=rng.choice([0, 2, 4]),
    )
    kv = KVCacheManager(12, BLOCK_SIZE, True)
    scheduler = Scheduler(config, kv, 32)
    requests = [
        Request(
            f"r{i}",
            [rng.randrange(3) for _ in range(rng.randint(1, 20))],
            SamplingParams(max_tokens=rng.randint(1, 12)),
            adapter_id=rng.choice([None, "a", "b", "c"]),
            meta=RequestMeta(tenant=rng.choice(["t1", "t2", "t3"]), tenant_weight=2.0),
        )
        for i in range(60)
    ]
    arrivals = {step: requests[step * 3 : step * 3 + 3] for step in range(20)}
    slots = {}  # (block_id, offset) -> (adapter_id, token) the runner would have written
    for step in range(3000):
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        if step >= 20 and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert scheduler.num_running <= config.max_num_seqs
        assert len({r.adapter_id for r in scheduler.running} - {None}) <= config.max_loras
        assert output.scheduled or not scheduler.num_waiting, f"step {step}: empty while requests wait"
        assert {s.request.request_id for s in output.scheduled} <= {r.request_id for r in scheduler.running}
        for item in output.scheduled:
            request, end = item.request, item.start + item.num_new_tokens
            assert len(item.block_ids) == kv.num_blocks_needed(end)
            expected = [(request.adapter_id, t) for t in request.all_token_ids[:end]]
            for pos in range(end):
                slot = (item.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                if pos >= item.start:
                    slots[slot] = expected[pos]
                assert slots[slot] == expected[pos]
            if item.samples:
                request.append_output_token(rng.randrange(3))
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    assert not scheduler.has_unfinished_requests()
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)
    assert kv.usage == 0.0 and scheduler.num_preemptions > 0


def test_share_is_each_tenants_part_of_about_the_last_minutes_service():
    now = [100.0]
    ledger = TenantLedger(lambda: now[0])
    ledger.generated("a", 1, 300.0)
    ledger.generated("b", 1, 100.0)

    def shares():
        return {t.tenant: t.share for t in ledger.stats({}, lambda tenant: 1.0, [], [])}

    assert shares() == {"a": 0.75, "b": 0.25}
    now[0] += SHARE_WINDOW_S  # older service fades by e per window
    ledger.generated("b", 1, 100.0)
    a, b = 300.0 / math.e, 100.0 / math.e + 100.0
    assert shares() == pytest.approx({"a": a / (a + b), "b": b / (a + b)})
