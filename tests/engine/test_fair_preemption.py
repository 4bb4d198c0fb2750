"""Fair preemption: a tenant below its share that finds the batch full (rows, KV blocks) preempts a
request of the tenant most over its share, and gets the token budget ahead of that tenant's prefills;
bounded so that it does not thrash, and recomputed victims give the same greedy tokens."""

import random
from dataclasses import dataclass, field

import pytest
from test_fair_scheduler import BLOCK_SIZE, flood, make_request, make_scheduler, merge, run, steady

from engine import fair_preemption
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.request_meta import RequestMeta
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


@dataclass
class FullBatch:
    """A's requests fill the batch; then B sends one request (or more) and one step runs."""

    config: dict
    a_prompts: list[int]  # A's requests, admitted together in the first step
    a_max_tokens: int = 30
    a_weight: float = 1.0
    b_prompts: list[int] = field(default_factory=lambda: [4])
    b_running: int = 0  # B's requests admitted beside A's before (taking rows A leaves)
    b_charged: float = 0.0  # extra service charged to B before its request arrives
    policy: str = "fair"
    steps_before: int = 2


# name: (case, B's requests admitted in the arrival step, A's victims by index into a_prompts)
CASES = {
    # 4 rows of A decoding: B takes the row of A's request with the fewest computed tokens (the first,
    # with the shortest prompt, although it is the oldest).
    "rows full: the fewest computed tokens go": (
        FullBatch(dict(max_num_seqs=4), a_prompts=[2, 16, 16, 16]),
        [0],
        [0],
    ),
    "rows full, equal work: the newest goes": (
        FullBatch(dict(max_num_seqs=4), a_prompts=[8, 8, 8, 8]),
        [0],
        [3],
    ),
    # 20 blocks: A's three 15-token prompts hold 12, B's 33-token prompt needs 9.
    "kv blocks full": (
        FullBatch(
            dict(max_num_seqs=8, num_blocks=20, max_model_len=48),
            a_prompts=[15, 15, 15],
            a_max_tokens=4,
            b_prompts=[33],
            steps_before=1,
        ),
        [0],
        [2],
    ),
    # A's decode and the next chunk of A's long prompt would take the whole budget: B's prefill goes first.
    "token budget taken by A's prefill": (
        FullBatch(
            dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64),
            a_prompts=[2, 60],
            a_max_tokens=4,
            b_prompts=[8],
            steps_before=1,
        ),
        [0],
        [],
    ),
    # Weight 3 holds 8 rows, 7 after the move: 2 x (0 + 1) / 1 <= (8 - 1) / 3; not a second time.
    "a heavier tenant still gives one row": (
        FullBatch(dict(max_num_seqs=8, num_blocks=128), a_prompts=[8] * 8, a_weight=3.0, b_prompts=[4, 4]),
        [0],
        [7],
    ),
    # Weight 3 with 4 rows: (4 - 1) / 3 < 2 x 1, so nothing moves.
    "a heavier tenant's fewer rows are its share": (
        FullBatch(dict(max_num_seqs=4), a_prompts=[8] * 4, a_weight=3.0),
        [],
        [],
    ),
    # B holds 1 of 4 rows: 2 x (1 + 1) > 3 - 1.
    "b already holds its part of the rows": (
        FullBatch(dict(max_num_seqs=4), a_prompts=[8, 8, 8], b_running=1),
        [],
        [],
    ),
    "b got more service than a (higher counter)": (
        FullBatch(dict(max_num_seqs=4), a_prompts=[8] * 4, b_charged=10_000.0),
        [],
        [],
    ),
    "fcfs never preempts for a tenant": (
        FullBatch(dict(max_num_seqs=4), a_prompts=[8] * 4, policy="fcfs"),
        [],
        [],
    ),
}


def fill_with_a(case: FullBatch):
    config = {"num_blocks": 64, "max_model_len": 64, **case.config}
    scheduler = make_scheduler(scheduling_policy=case.policy, **config)
    a = [make_request("a", n, case.a_max_tokens, weight=case.a_weight) for n in case.a_prompts]
    b_before = [make_request("b", 4, 60) for _ in range(case.b_running)]
    run(scheduler, {0: a + b_before}, case.steps_before)
    assert all(r.status is RequestStatus.RUNNING for r in a + b_before)
    if case.b_charged:
        scheduler.counters.charge("b", num_prompt_tokens=int(case.b_charged))
    b = [make_request("b", n, 4) for n in case.b_prompts]
    return scheduler, a, b


@pytest.mark.parametrize("name", list(CASES))
def test_a_tenant_below_its_share_is_scheduled_in_the_step_it_arrives(name):
    case, admitted, victims = CASES[name]
    scheduler, a, b = fill_with_a(case)
    output = run(scheduler, {0: b}, 1).outputs[0]
    assert [b.index(r) for r in output.newly_admitted if r in b] == admitted
    assert [a.index(r) for r in output.preempted] == victims
    assert scheduler.num_admission_preemptions == len(victims)
    scheduled = {s.request for s in output.scheduled}
    assert all(b[i] in scheduled for i in admitted)
    assert all(r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in output.preempted)
    # The victims come back later and finish with all their tokens, preempted once.
    run(scheduler, {}, 400)
    assert not scheduler.has_unfinished_requests()
    assert all(r.num_output_tokens == case.a_max_tokens for r in a)
    assert [r.num_preemptions for r in a] == [int(i in victims) for i in range(len(a))]
    assert all(r.num_output_tokens == 4 for r in b)


def test_b_prefill_gets_the_budget_before_a_running_prefill_and_a_gets_the_rest():
    case, _, _ = CASES["token budget taken by A's prefill"]
    scheduler, a, b = fill_with_a(case)
    output = run(scheduler, {0: b}, 1).outputs[0]
    chunks = {s.request: s.num_new_tokens for s in output.scheduled}
    assert chunks == {a[0]: 1, a[1]: 16 - 1 - 8, b[0]: 8}  # decode, the rest of A's chunk, all of B's
    assert output.num_batched_tokens == 16
    # B's request goes after A's in the batch: blocks A registers this step come before any hit on them.
    assert [s.request for s in output.scheduled] == [a[0], a[1], b[0]]


def test_what_admission_leaves_goes_back_to_the_prefill_that_made_room():
    """B's head waits for its adapter: the budget reserved for it goes back to A's prefill at once."""
    loaded: set[str] = set()
    scheduler = make_scheduler(
        max_num_batched_tokens=16, max_model_len=64, adapter_ready=lambda adapter_id: adapter_id in loaded
    )
    a = make_request("a", 60, 2)
    run(scheduler, {0: [a]}, 1)
    b = make_request("b", 8, 2, adapter_id="x")
    output = run(scheduler, {0: [b]}, 1).outputs[0]
    assert [(s.request, s.num_new_tokens) for s in output.scheduled] == [(a, 16)]


@pytest.mark.parametrize(
    ("name", "arrivals", "fairness_preemptions"),
    [
        # Two tenants that both keep the batch busy do not trade rows over small differences.
        ("two equal floods", lambda: merge(flood("a", 150, 12, 6), flood("b", 150, 12, 6)), (0, 0)),
        (
            "floods, 1:2 weights",
            lambda: merge(flood("a", 150, 12, 6), flood("b", 150, 12, 6, weight=2.0)),
            (0, 2),
        ),
        ("floods, long vs short", lambda: merge(flood("a", 150, 40, 6), flood("b", 150, 6, 6)), (0, 2)),
        # A light tenant preempts at most once per request of its own (60 of them here).
        ("a floods, b steady", lambda: merge(flood("a", 150, 40, 8), steady("b", 5, 300, 8, 4)), (1, 60)),
    ],
)
def test_no_thrashing(name, arrivals, fairness_preemptions):
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=64, max_num_seqs=8)
    planned = arrivals()
    requests = [r for batch in planned.values() for r in batch]
    preempted_by_step = [len(o.preempted) for o in run(scheduler, planned, 400).outputs]
    assert not scheduler.has_unfinished_requests()
    # Blocks never ran out: every preemption made room for a tenant, each request suffered at most one.
    low, high = fairness_preemptions
    assert scheduler.num_preemptions == scheduler.num_admission_preemptions
    assert low <= scheduler.num_admission_preemptions <= high
    assert all(r.num_preemptions <= 1 for r in requests)
    assert max(preempted_by_step) <= 1  # one row per step, for one request of B's


def test_victims_never_include_a_request_sharing_blocks_registered_this_step():
    """With prefix caching, a request admitted in a step may hit blocks that a running prefill registered
    for that very step: preempting the prefill then would leave the other reading K/V nobody writes."""
    config = EngineConfig(
        model="test", block_size=BLOCK_SIZE, num_kv_blocks=64, max_num_seqs=3, max_num_batched_tokens=24
    )
    kv = KVCacheManager(64, BLOCK_SIZE, True)
    scheduler = Scheduler(config, kv, 64)
    prefix = list(range(100, 116))
    decoding = Request(
        "decoding", list(range(200, 214)), SamplingParams(max_tokens=20), meta=RequestMeta(tenant="a")
    )
    prefilling = Request("prefilling", prefix, SamplingParams(max_tokens=20), meta=RequestMeta(tenant="a"))
    run(scheduler, {0: [decoding, prefilling]}, 1)  # 14 tokens, then the first 10 of 16
    same_prefix = Request(
        "same-prefix", prefix + [1, 2], SamplingParams(max_tokens=2), meta=RequestMeta(tenant="a")
    )
    b = make_request("b", 4, 2)
    output = run(scheduler, {0: [same_prefix, b]}, 1).outputs[0]
    # The prefill registers blocks 2-3 for this step, same-prefix hits them and takes the last row;
    # b preempts the decoding request, although the prefill has fewer computed tokens.
    assert same_prefix.num_cached_tokens == 16
    assert output.newly_admitted == [same_prefix, b]
    assert output.preempted == [decoding]


def test_pick_victims_takes_the_highest_counter_tenant_and_only_what_frees_enough_blocks():
    config = EngineConfig(model="test", block_size=BLOCK_SIZE, num_kv_blocks=32, enable_prefix_caching=False)
    scheduler = Scheduler(config, KVCacheManager(32, BLOCK_SIZE, False), 64)
    running = [make_request(t, n, 20) for t, n in [("x", 8), ("y", 4), ("y", 12), ("y", 8), ("y", 8)]]
    run(scheduler, {0: running}, 1)
    scheduler.counters.charge("y", num_prompt_tokens=100)
    kv, counters = scheduler.kv_cache_manager, scheduler.counters
    t = make_request("t", 4, 2)

    def pick(need_row, num_missing_blocks):
        victims = fair_preemption.pick_victims(
            t, running, [], counters, kv, need_row=need_row, num_missing_blocks=num_missing_blocks
        )
        return [running.index(v) for v in victims]

    assert pick(True, 0) == [1]  # y is most over its share; its request with the fewest tokens
    assert pick(False, 3) == [1, 4]  # 1 block, then 2 of the newest of equals; y keeps 2 of its 4 rows
    assert pick(False, 20) == []  # cannot be had (y may give 2 rows, x none): nobody is preempted


@pytest.mark.parametrize("seed", range(3))
def test_random_floods_with_shared_prefixes_keep_the_kv_cache_consistent(seed):
    """Prefix caching, shared prompt prefixes, a tight cache and small budgets: fair preemption, capped
    prefills and KV preemption together; what the runner would read is always what it wrote."""
    rng = random.Random(seed)
    config = EngineConfig(
        model="test",
        block_size=BLOCK_SIZE,
        num_kv_blocks=24,
        max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_num_seqs=rng.choice([3, 6]),
    )
    kv = KVCacheManager(24, BLOCK_SIZE, True)
    scheduler = Scheduler(config, kv, 40)
    prefixes = [[rng.randrange(5) for _ in range(8)] for _ in range(2)]

    def request(i, tenant):
        prompt = rng.choice(prefixes)[: rng.randint(0, 8)] + [
            rng.randrange(5) for _ in range(rng.randint(1, 12))
        ]
        return Request(
            f"{tenant}{i}",
            prompt,
            SamplingParams(max_tokens=rng.randint(1, 10)),
            meta=RequestMeta(tenant=tenant),
        )

    arrivals = {0: [request(i, "a") for i in range(30)]}
    for step in range(1, 60, 4):
        arrivals[step] = [request(step, "b")]
    requests = [r for batch in arrivals.values() for r in batch]
    slots = {}  # (block_id, offset) -> token the runner would have written there
    for step in range(3000):
        for r in arrivals.get(step, []):
            scheduler.add_request(r)
        if step >= 60 and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        assert output.scheduled or not scheduler.num_waiting, f"step {step}: empty while requests wait"
        for item in output.scheduled:
            r, end = item.request, item.start + item.num_new_tokens
            for pos in range(end):
                slot = (item.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                if pos >= item.start:
                    slots[slot] = r.all_token_ids[pos]
                assert slots.get(slot) == r.all_token_ids[pos], f"step {step}: {r.request_id} reads stale K/V"
            if item.samples:
                r.append_output_token(rng.randrange(5))
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    assert not scheduler.has_unfinished_requests()
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)
    assert kv.usage == 0.0


# -- engine level: the victim's recomputed tokens ------------------------------------------------------


@pytest.mark.parametrize(
    ("async_scheduling", "caching"),
    [(False, True), (True, True), (False, False)],
    ids=["sync", "async", "no-cache"],
)
def test_a_preempted_victim_resumes_with_the_same_greedy_tokens(text_model_dir, async_scheduling, caching):
    from engine import LLMEngine

    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    prompts = {f"a{i}": [10 + i, 20, 30 + i, 40, 50, 60 + i] for i in range(4)}
    prompts["b0"] = [7, 8, 9, 11]

    def engine(**overrides):
        config = dict(model=str(text_model_dir), block_size=4, max_model_len=64, num_kv_blocks=64)
        return LLMEngine(EngineConfig(**{**config, **overrides}), skip_tokenizer_init=True)

    def drain(eng, tokens):
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)

    expected: dict[str, list[int]] = {}
    alone = engine(max_num_seqs=8)
    for request_id, prompt in prompts.items():
        alone.add_request(request_id, prompt, greedy, meta=RequestMeta(tenant=request_id[0]))
    drain(alone, expected)

    crowded = engine(max_num_seqs=3, async_scheduling=async_scheduling, enable_prefix_caching=caching)
    got: dict[str, list[int]] = {}
    for request_id in ("a0", "a1", "a2", "a3"):
        crowded.add_request(request_id, prompts[request_id], greedy, meta=RequestMeta(tenant="a"))
    for _ in range(3):
        crowded.step()
    scheduler = crowded.scheduler
    assert {r.request_id for r in scheduler.running} == {"a0", "a1", "a2"}
    crowded.add_request("b0", prompts["b0"], greedy, meta=RequestMeta(tenant="b"))
    crowded.step()
    assert "b0" in {r.request_id for r in scheduler.running}  # admitted in the step it arrived
    assert scheduler.num_admission_preemptions == 1
    drain(crowded, got)
    assert got == expected
