"""Scheduler: budgets, chunked prefill, adapter limits, preemption, and invariants over whole runs."""

import random

import pytest

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler

BLOCK_SIZE = 4
SAMPLED_TOKEN = 7
_POLICY = {"name": "fair"}  # set per test by `policy`: with one tenant and one priority all behave alike


@pytest.fixture(autouse=True, params=["fair", "fcfs", "priority"])
def policy(request):
    _POLICY["name"] = request.param
    yield request.param
    _POLICY["name"] = "fair"


def make_scheduler(
    *, num_blocks=64, max_model_len=64, caching=False, adapter_ready=lambda adapter_id: True, **config
):
    config = EngineConfig(
        model="test",
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=caching,
        scheduling_policy=_POLICY["name"],
        **config,
    )
    kv_cache_manager = KVCacheManager(num_blocks, BLOCK_SIZE, caching)
    return Scheduler(config, kv_cache_manager, max_model_len, adapter_ready)


def make_request(request_id, num_prompt_tokens, adapter_id=None, max_tokens=8, first_token=0):
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), adapter_id=adapter_id)


def add(scheduler, *requests):
    for request in requests:
        scheduler.add_request(request)
    return requests


def step(scheduler):
    """One engine step: schedule, sample for requests that finished their known tokens, finish at max_tokens."""
    output = scheduler.schedule()
    for item in output.scheduled:
        if item.samples:
            item.request.append_output_token(SAMPLED_TOKEN)
            if item.request.num_output_tokens >= item.request.sampling_params.max_tokens:
                scheduler.finish_request(item.request.request_id, RequestStatus.FINISHED_LENGTH)
    return output


def summary(output):
    return [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in output.scheduled]


def ids(requests):
    return [r.request_id for r in requests]


@pytest.mark.parametrize(("max_num_seqs", "num_requests", "admitted"), [(1, 3, 1), (2, 3, 2), (4, 3, 3)])
def test_max_num_seqs_caps_running(max_num_seqs, num_requests, admitted):
    scheduler = make_scheduler(max_num_seqs=max_num_seqs)
    add(scheduler, *(make_request(f"r{i}", 4) for i in range(num_requests)))
    output = step(scheduler)
    assert (len(output.scheduled), scheduler.num_running, scheduler.num_waiting) == (
        admitted,
        admitted,
        num_requests - admitted,
    )


@pytest.mark.parametrize(
    ("chunked", "budget", "expected"),
    [
        (False, 64, [("r0", 0, 8, True), ("r1", 0, 8, True), ("r2", 0, 8, True)]),
        (False, 20, [("r0", 0, 8, True), ("r1", 0, 8, True)]),  # r2 does not fit whole: waits
        (True, 20, [("r0", 0, 8, True), ("r1", 0, 8, True), ("r2", 0, 4, False)]),
        (True, 6, [("r0", 0, 6, False)]),
    ],
)
def test_max_num_batched_tokens_caps_a_step(chunked, budget, expected):
    scheduler = make_scheduler(
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        max_model_len=budget if not chunked else 64,
    )
    add(scheduler, *(make_request(f"r{i}", 8) for i in range(3)))
    output = step(scheduler)
    assert summary(output) == expected
    assert output.num_batched_tokens == sum(n for _, _, n, _ in expected) <= budget


def test_chunked_prefill_splits_a_long_prompt_between_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add(scheduler, make_request("a", 4), make_request("b", 30))
    steps = [summary(step(scheduler)) for _ in range(5)]
    assert steps == [
        [("a", 0, 4, True), ("b", 0, 6, False)],
        [("a", 4, 1, True), ("b", 6, 9, False)],  # the decode goes first; the prompt takes the rest
        [("a", 5, 1, True), ("b", 15, 9, False)],
        [("a", 6, 1, True), ("b", 24, 6, True)],
        [("a", 7, 1, True), ("b", 30, 1, True)],
    ]


def test_without_chunked_prefill_a_long_prompt_waits_for_room():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    add(scheduler, make_request("a", 4), make_request("b", 30), make_request("c", 2))
    assert summary(step(scheduler)) == [("a", 0, 4, True)]  # b (30 > 28 left) waits, and c behind it
    assert summary(step(scheduler)) == [("a", 4, 1, True), ("b", 0, 30, True)]  # c: 2 > 1 left
    assert summary(step(scheduler)) == [("a", 5, 1, True), ("b", 30, 1, True), ("c", 0, 2, True)]


def test_scheduler_refuses_a_budget_below_max_model_len_without_chunking():
    with pytest.raises(ValueError, match="chunked prefill"):
        make_scheduler(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)


def test_max_loras_skips_a_new_adapter_and_admits_it_later():
    scheduler = make_scheduler(max_loras=2)
    add(
        scheduler,
        make_request("r0", 4, "a", max_tokens=2),
        make_request("r1", 4, "b", max_tokens=9),
        make_request("r2", 4, "c"),
        make_request("r3", 4, None),
        make_request("r4", 4, "a", max_tokens=2),
        make_request("r5", 4, "d"),
    )
    first = step(scheduler)
    assert ids(first.newly_admitted) == ["r0", "r1", "r3", "r4"]
    assert ids(scheduler.waiting) == ["r2", "r5"]  # skipped, order kept
    second = step(scheduler)  # r0 and r4 finish here: adapter "a" leaves
    assert second.newly_admitted == []
    third = step(scheduler)
    assert ids(third.newly_admitted) == ["r2"]  # "b" and "c" now; "d" still waits
    assert ids(scheduler.waiting) == ["r5"]


@pytest.mark.parametrize(
    ("ready", "first_admitted", "still_waiting"),
    [
        (set(), ["r1"], ["r0", "r2"]),
        ({"x"}, ["r0", "r1"], ["r2"]),
        ({"x", "y"}, ["r0", "r1", "r2"], []),
    ],
)
def test_a_request_whose_adapter_is_not_ready_waits_without_holding_others(
    ready, first_admitted, still_waiting
):
    loaded = set(ready)
    scheduler = make_scheduler(adapter_ready=lambda adapter_id: adapter_id in loaded)
    add(scheduler, make_request("r0", 4, "x"), make_request("r1", 4, None), make_request("r2", 4, "y"))
    assert ids(step(scheduler).newly_admitted) == first_admitted
    assert ids(scheduler.waiting) == still_waiting
    loaded.update({"x", "y"})
    assert ids(step(scheduler).newly_admitted) == still_waiting


def test_the_newest_request_is_preempted_and_recomputed_from_zero():
    # 4 blocks of 4 tokens; each request alone fits (6 + 10 = 16 tokens), together they do not.
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    a, b = add(
        scheduler, make_request("a", 6, max_tokens=10), make_request("b", 6, max_tokens=10, first_token=50)
    )
    for _ in range(3):
        step(scheduler)  # prefill, then decodes to 8 tokens each: all 4 blocks in use
    output = step(scheduler)  # a needs a third block
    assert (summary(output), output.preempted) == ([("a", 8, 1, True)], [b])
    assert (b.status, b.num_computed_tokens, b.num_preemptions, scheduler.num_preemptions) == (
        RequestStatus.PREEMPTED,
        0,
        1,
        1,
    )
    assert ids(scheduler.waiting) == ["b"] and scheduler.kv_cache_manager.get_block_ids("b") == []
    while scheduler.num_running:  # b cannot come back while a holds 3 blocks and grows to 4
        assert step(scheduler).newly_admitted == []
    output = step(scheduler)
    # prompt and the 3 outputs so far are recomputed in one step, which samples its 4th token.
    assert (summary(output), output.newly_admitted) == ([("b", 0, 9, True)], [b])
    assert b.all_token_ids == [*range(50, 56), SAMPLED_TOKEN, SAMPLED_TOKEN, SAMPLED_TOKEN, SAMPLED_TOKEN]


def test_the_newest_request_preempts_itself_when_it_cannot_grow():
    scheduler = make_scheduler(num_blocks=5, max_model_len=20)
    a, b = add(scheduler, make_request("a", 11, max_tokens=4), make_request("b", 8, max_tokens=4))
    step(scheduler)  # 3 + 2 blocks: the cache is full
    output = step(scheduler)  # a fits its open block; b needs a new one and is the newest
    assert (summary(output), ids(output.preempted), ids(scheduler.running)) == (
        [("a", 11, 1, True)],
        ["b"],
        ["a"],
    )


def test_several_preemptions_keep_the_older_request_first_in_waiting():
    scheduler = make_scheduler(num_blocks=6, max_model_len=24)
    add(scheduler, *(make_request(n, 8, max_tokens=4, first_token=10 * i) for i, n in enumerate("abc")))
    step(scheduler)  # 2 blocks each: full
    output = step(scheduler)  # a needs a third block: c goes, then b is fine with c's blocks
    assert ids(output.preempted) == ["c"]
    assert summary(output) == [("a", 8, 1, True), ("b", 8, 1, True)]
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    add(scheduler, make_request("d", 4))
    assert ids(step(scheduler).newly_admitted) == ["c", "d"]


@pytest.mark.parametrize("where", ["running", "waiting"])
def test_finish_request_frees_blocks_at_once(where):
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = add(scheduler, make_request("run", 9), make_request("wait", 4))
    step(scheduler)
    request = running if where == "running" else waiting
    assert scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED) is request
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.get_block_ids(request.request_id) == []
    assert request not in scheduler.running and request not in scheduler.waiting
    expected_usage = 0.0 if where == "running" else 3 / 64
    assert scheduler.kv_cache_manager.usage == pytest.approx(expected_usage)
    assert scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED) is None


@pytest.mark.parametrize(
    ("num_blocks", "num_prompt_tokens", "max_tokens", "message"),
    [
        (8, 65, 1, "more than max_model_len"),
        (8, 20, 50, "need 16 KV blocks"),  # 70 tokens, capped at max_model_len 64: more than 8 * 4
        (8, 20, None, "need 16 KV blocks"),  # no max_tokens: it may run to max_model_len
        (8, 20, 13, "need 9 KV blocks"),
        (8, 20, 12, None),  # 32 tokens: exactly the cache
        (16, 64, 1, None),  # a prompt of max_model_len tokens is fine; it stops there
    ],
)
def test_add_request_rejects_requests_that_could_never_run(
    num_blocks, num_prompt_tokens, max_tokens, message
):
    scheduler = make_scheduler(num_blocks=num_blocks, max_model_len=64)
    request = make_request("r", num_prompt_tokens, max_tokens=max_tokens)
    if message is None:
        scheduler.add_request(request)
        assert ids(scheduler.waiting) == ["r"]
        return
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(request)
    assert not scheduler.has_unfinished_requests()


def test_add_request_rejects_a_duplicate_id():
    scheduler = make_scheduler()
    add(scheduler, make_request("r", 4))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r", 4))


def test_prefix_hits_are_recorded_and_skipped():
    scheduler = make_scheduler(caching=True)
    add(scheduler, make_request("a", 10, "x"))
    step(scheduler)
    b, c = add(scheduler, make_request("b", 10, "x"), make_request("c", 10, "y"))
    output = step(scheduler)
    assert summary(output)[1:] == [("b", 8, 2, True), ("c", 0, 10, True)]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 0)


def test_samples_is_fixed_at_scheduling_time():
    request = make_request("r", 4)
    item = ScheduledRequest(request=request, num_new_tokens=4, start=0, block_ids=[0])
    request.append_output_token(SAMPLED_TOKEN)
    assert item.samples


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_blocks=12, max_num_batched_tokens=16, max_num_seqs=4, max_loras=2),
        dict(
            num_blocks=12,
            max_num_batched_tokens=32,
            enable_chunked_prefill=False,
            max_loras=1,
            max_model_len=32,
        ),
        dict(num_blocks=16, max_num_batched_tokens=8, max_num_seqs=8, max_loras=3, caching=True),
        dict(num_blocks=10, max_num_batched_tokens=64, max_num_seqs=16, max_loras=2, caching=True),
    ],
)
def test_random_workloads_respect_every_limit_and_finish(settings):
    settings = {"max_model_len": 32, **settings}
    scheduler = make_scheduler(**settings)
    config, kv = scheduler.config, scheduler.kv_cache_manager
    rng = random.Random(0)
    # Tokens drawn from a tiny vocabulary, so prompts share prefixes and prefix caching gets exercised.
    requests = [
        Request(
            f"r{i}",
            [rng.randrange(3) for _ in range(rng.randint(1, 20))],
            SamplingParams(max_tokens=rng.randint(1, 12)),
            adapter_id=rng.choice([None, "a", "b", "c"]),
        )
        for i in range(40)
    ]
    add(scheduler, *requests)
    slots = {}  # (block_id, offset) -> (adapter_id, token): what the runner would have written
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert scheduler.num_running <= config.max_num_seqs
        assert len({r.adapter_id for r in scheduler.running} - {None}) <= config.max_loras
        for item in output.scheduled:
            request, end = item.request, item.start + item.num_new_tokens
            assert len(item.block_ids) == kv.num_blocks_needed(end)
            expected = [(request.adapter_id, t) for t in request.all_token_ids[:end]]
            for pos in range(end):  # reads of earlier tokens, prefix hits included, then this step's writes
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
    assert kv.usage == 0.0
    # The workload is tight enough to exercise preemption, and prefix hits where caching is on.
    assert scheduler.num_preemptions > 0
    assert (kv.num_hit_tokens > 0) == kv.enable_caching
