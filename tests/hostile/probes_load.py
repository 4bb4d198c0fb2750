"""Load-shaped probes (issue 30 items 1, 2, 3, 4, 8, 10): the prefix cache across tenants, grammar
compiles and large bodies beside another tenant's small requests, the token rate charged as used, clients
that leave before their first token, and the abort/error counters."""

from __future__ import annotations

import asyncio
import contextlib
import random

from client import Api, StreamResult, cut_before_headers, gather_bounded
from stack import CAROL_CONCURRENCY, TOKENS_PER_MINUTE, admin, user
from tally import STALL_BOUND_S, Tally

WORDS = "the quick brown fox jumps over the lazy dog. "
SMALL = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}


def text(num_bytes: int) -> str:
    return (WORDS * (num_bytes // len(WORDS) + 1))[:num_bytes]


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@contextlib.asynccontextmanager
async def bystander(api: Api, tally: Tally, label: str):
    """bob's 4-token completions and /tokenize calls, one after another, while the block runs: each must
    answer within STALL_BOUND_S."""
    stop = asyncio.Event()
    latencies: list[float] = []

    async def loop() -> None:
        while not stop.is_set():
            for method, path, body in (
                ("POST", "/v1/completions", SMALL),
                ("POST", "/tokenize", {"prompt": "hello there"}),
            ):
                response, seconds = await api.timed(method, path, user("bob"), json=body)
                tally.answer(response, refuse=False, what=f"bob's {path} during {label}")
                latencies.append(seconds)
                if seconds > STALL_BOUND_S:
                    tally.failed("stalls", f"bob's {path} took {seconds:.1f} s during {label}")
            await asyncio.sleep(0.2)

    task = asyncio.create_task(loop())
    try:
        yield latencies
    finally:
        stop.set()
        await task


async def prefix_cache(api: Api, tally: Tally, rounds: int) -> None:
    tally.begin("1 prefix cache across tenants")
    rng = random.Random(7)

    async def cached(key: str, prompt, **extra) -> int | None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra}
        response = tally.answer(
            await api.call("POST", "/v1/completions", key, json=body), refuse=False, what="cache probe"
        )
        if response.status_code != 200:
            return None
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for i in range(rounds):
        prompt = [rng.randrange(3, 290) for _ in range(36)]  # 9 blocks of 4
        salt = {"cache_salt": "shared-salt"} if i % 2 else {}
        await cached(user("alice"), prompt, **salt)
        again = await cached(admin("alice"), prompt, **salt)
        if again == 0:
            tally.failed("other", f"alice's own repeated prompt hit nothing (round {i})")
        hit = await cached(user("bob"), prompt, **salt)
        if hit:
            tally.failed("leaks", f"bob hit {hit} of alice's prompt tokens in the cache (round {i})")
        if not await cached(admin("bob"), prompt, **salt):  # bob's own second time does hit
            tally.failed("other", f"bob's own repeated prompt hit nothing (round {i})")
    system = [{"role": "system", "content": "You are Acme's internal support bot. Secret code 4411."}]
    for key in (user("alice"), user("alice"), user("bob")):
        body = {"model": "tiny", "messages": system, "max_tokens": 1}
        response = tally.answer(
            await api.call("POST", "/v1/chat/completions", key, json=body),
            refuse=False,
            what="chat cache probe",
        )
        hit = (
            response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if response.status_code == 200
            else 0
        )
        if key == user("bob") and hit:
            tally.failed("leaks", f"bob hit {hit} tokens of alice's system prompt")


async def grammar(api: Api, tally: Tally) -> None:
    tally.begin("2 grammar compiles vs other tenants")
    key = user("alice")
    too_big = [
        {"guided_json": nested_arrays(600)},
        {"guided_json": {"enum": [f"v{i}" for i in range(20_000)]}},
        {"guided_regex": "|".join(f"w{i}" for i in range(5000))},
        {"guided_grammar": "root ::= " + " | ".join(f'"g{i}"' for i in range(5000))},
        {"guided_choice": [f"c{i}" for i in range(5000)]},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": nested_arrays(600)},
            }
        },
    ]
    # within the budget but unique each time (nothing cached): what a tenant may legally send
    legal = [
        {"guided_json": {"type": "object", "properties": {f"f{i}_{j}": nested_arrays(30) for j in range(8)}}}
        for i in range(8)
    ] + [{"guided_json": {"enum": [f"u{i}-{j}" for j in range(4000)]}} for i in range(4)]
    async with bystander(api, tally, "grammar compiles") as latencies:
        bodies = [(spec, True) for spec in too_big * 3] + [(spec, None) for spec in legal]
        answers = await gather_bounded(
            (api.call("POST", "/v1/completions", key, json={**SMALL, **spec}) for spec, _ in bodies), 12
        )
        for (spec, refuse), answer in zip(bodies, answers, strict=True):
            if isinstance(answer, Exception):
                tally.failed("stalls", f"a structured request got no answer: {answer!r}")
            else:
                tally.answer(answer, refuse=refuse, what=f"spec {str(spec)[:50]}")
        await _cap_before_compile(api, tally)
    tally.row().note(
        f"info: bob's slowest small request or /tokenize meanwhile: {max(latencies, default=0):.2f} s"
    )


async def _cap_before_compile(api: Api, tally: Tally) -> None:
    """carol at her concurrency cap: a schema must get its 429 at once, not after a compile."""
    holders = [
        asyncio.create_task(api.stream("/v1/completions", user("carol"), LONG))
        for _ in range(CAROL_CONCURRENCY)
    ]
    await asyncio.sleep(1.0)
    for i in range(6):
        spec = {
            "guided_json": {
                "type": "object",
                "properties": {f"cap{i}_{j}": nested_arrays(40) for j in range(6)},
            }
        }
        response, seconds = await api.timed("POST", "/v1/completions", user("carol"), json={**SMALL, **spec})
        tally.answer(response, refuse=None, what="a schema over carol's cap")
        if response.status_code == 429 and seconds > 2.0:
            tally.failed("stalls", f"carol's 429 took {seconds:.1f} s")
    for holder in holders:
        result = await holder
        tally.tried()
        if result.status != 200 or not result.done:
            tally.failed("other", f"carol's holder stream ended badly: {result}")


async def large_bodies(api: Api, tally: Tally) -> None:
    tally.begin("3 large bodies vs the event loop")
    chat = [{"role": "user", "content": text(900)} for _ in range(4000)]
    bodies = [
        ("/v1/completions", {"model": "tiny", "prompt": text(15 << 20)}),
        ("/v1/completions", {"model": "tiny", "prompt": [text(240_000)] * 64}),
        ("/v1/completions", {"model": "tiny", "prompt": [text(58_000)] * 64}),
        ("/v1/completions", {"model": "tiny", "prompt": text(3_800_000)}),
        ("/v1/chat/completions", {"model": "tiny", "messages": chat}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * 10_000}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * 200_000},
        ),
        ("/tokenize", {"prompt": text(3_800_000)}),
        ("/tokenize", {"messages": chat}),
    ]
    async with bystander(api, tally, "large bodies") as latencies:
        for _ in range(2):
            calls = [api.call("POST", path, user("alice"), json=body) for path, body in bodies]
            for (path, _), answer in zip(
                bodies, await asyncio.gather(*calls, return_exceptions=True), strict=True
            ):
                if isinstance(answer, Exception):
                    tally.failed("stalls", f"{path}: no answer ({answer!r})")
                else:
                    tally.answer(answer, refuse=True, what=f"large {path}")
    tally.row().note(
        f"info: bob's slowest small request or /tokenize meanwhile: {max(latencies, default=0):.2f} s"
    )


async def token_rate(api: Api, tally: Tally) -> None:
    """carol's 2,000 tokens a minute: requests without max_tokens (n=16) are charged as they generate; one
    admitted while her window is full, or use the window does not show, is a failure."""
    tally.begin("4 tokens per minute, charged as used")
    used = 0
    for i in range(8):
        usage = (await api.call("GET", "/v1/usage", admin("carol"))).json()
        window = usage["tokens_last_minute"]
        if i and window < used * 0.9:
            tally.failed("leaks", f"carol used {used} tokens this minute, /v1/usage shows {window}")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a story"}], "n": 16}
        if i % 2:
            body["max_tokens"] = 100
        response = await api.call("POST", "/v1/chat/completions", user("carol"), json=body)
        tally.answer(response, refuse=None, what="carol's n=16 request")
        if response.status_code == 200:
            if window >= TOKENS_PER_MINUTE:
                tally.failed("wrongly_accepted", f"admitted with {window} of {TOKENS_PER_MINUTE} tokens used")
            used += response.json()["usage"]["total_tokens"]
    usage = (await api.call("GET", "/v1/usage", admin("carol"))).json()
    if usage["tokens_last_minute"] < used * 0.9:
        tally.failed("leaks", f"carol used {used} tokens, /v1/usage shows {usage['tokens_last_minute']}")
    tally.row().note(
        f"info: carol used {used} tokens against {TOKENS_PER_MINUTE}/min; window shows {usage['tokens_last_minute']}"
    )


async def early_disconnects(api: Api, tally: Tally, metrics: Api, rounds: int) -> None:
    """While bob's long streams fill the batch, carol's streams hang up before their first token (before
    the headers, or right after them): none may keep her concurrency lease."""
    tally.begin("8 clients leaving before the first token")
    aborts_before = await counter(metrics, "abort")
    load = [asyncio.create_task(api.stream("/v1/completions", user("bob"), LONG)) for _ in range(40)]
    await asyncio.sleep(1.0)
    for i in range(rounds):
        if i % 2:
            await asyncio.gather(
                *(cut_before_headers(api.base_url, user("carol"), LONG) for _ in range(CAROL_CONCURRENCY))
            )
        else:
            results = await asyncio.gather(
                *(
                    api.stream("/v1/completions", user("carol"), LONG, cut_before_first=True)
                    for _ in range(CAROL_CONCURRENCY)
                )
            )
            for result in results:
                if result.status >= 500:
                    tally.failed("server_errors", f"early-cut stream: {result.status}")
        tally.tried(CAROL_CONCURRENCY)
        tally.streams += CAROL_CONCURRENCY
    await asyncio.sleep(3.0)
    # every lease must be back: carol's cap of requests at once must all be admitted
    answers = await asyncio.gather(
        *(
            api.call("POST", "/v1/completions", user("carol"), json={**SMALL, "max_tokens": 1})
            for _ in range(CAROL_CONCURRENCY)
        )
    )
    for answer in answers:
        tally.answer(answer, refuse=False, what="carol after her streams left (a lease still held?)")
    for task in load:
        result = await task
        tally.tried()
        tally.streams += 1
        if result.status != 200 or not result.done or result.error:
            tally.failed("other", f"bob's stream under the early cuts: {result}")
    aborts = await counter(metrics, "abort") - aborts_before
    if aborts < rounds * CAROL_CONCURRENCY * 0.5:
        tally.failed(
            "other", f"only {aborts:.0f} aborts counted for {rounds * CAROL_CONCURRENCY} streams that left"
        )


async def counter(metrics: Api, reason: str) -> float:
    text_ = (await metrics.call("GET", "/metrics", None)).text
    total = 0.0
    for line in text_.splitlines():
        if line.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def success_counter(api: Api, tally: Tally, metrics: Api) -> None:
    """vllm:request_success_total must count streams cut mid-way (abort) and requests failed (error)."""
    tally.begin("10 request_success_total counts abort and error")
    aborts, errors = await counter(metrics, "abort"), await counter(metrics, "error")
    cut = await asyncio.gather(
        *(api.stream("/v1/completions", user("alice"), LONG, cut_after=1) for _ in range(12))
    )
    spec = {"guided_choice": ["a"], "min_tokens": 5, "max_tokens": 8}
    dry = await asyncio.gather(
        *(api.stream("/v1/completions", user("alice"), {**SMALL, **spec}) for _ in range(6))
    )
    tally.tried(len(cut) + len(dry))
    tally.streams += len(cut) + len(dry)
    await asyncio.sleep(2.0)
    aborted, failed = await counter(metrics, "abort") - aborts, await counter(metrics, "error") - errors
    if aborted < sum(r.cut for r in cut):
        tally.failed(
            "other", f"{aborted:.0f} aborts counted for {sum(r.cut for r in cut)} streams cut mid-way"
        )
    ended_in_error = sum(1 for r in dry if r.error is not None)  # a 400 before the stream is no completion
    if failed < ended_in_error:
        tally.failed(
            "other", f"{failed:.0f} errors counted for {ended_in_error} streams that ended in an error"
        )
    tally.row().note(
        f"info: {aborted:.0f} aborts counted for {sum(r.cut for r in cut)} cut streams; "
        f"{failed:.0f} errors for {ended_in_error} streams ending in an error event"
    )


def stream_ok(
    tally: Tally,
    result: StreamResult | BaseException,
    what: str,
    refuse: bool | None = False,
    error_ok: bool = False,
) -> None:
    """One stream: a 5xx, an exception, or an uncut stream without its [DONE] (or with an error event,
    unless `error_ok`: the engine died) is a failure."""
    tally.tried()
    tally.streams += 1
    if isinstance(result, BaseException):
        tally.failed("other", f"{what}: {result!r}")
        return
    if result.status >= 500:
        tally.failed("server_errors", f"{what}: {result.status} {result.text[:120]}")
    elif result.status != 200:
        if refuse is False and result.status != 429:
            tally.failed("other", f"{what}: {result.status} {result.text[:120]}")
        tally.scan(result.text, what)
    elif not result.cut and (not result.done or (result.error and not error_ok)):
        tally.failed("other", f"{what}: ended without [DONE] or with an error {result.error}")
