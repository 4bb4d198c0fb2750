"""One engine core, several front ends ("clients"): each gets the outputs of the requests it added and
nobody else's, may abort only its own, a client that goes away has its requests aborted, and the core's
death ends every client's streams, including those of clients that did not start it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from processes import kill_quietly, wait_gone

from engine import AsyncLLM, EngineConfig, EngineDeadError, SamplingParams
from engine.core_process.handle import CoreHandle
from engine.messages import ClientGone

ENGINE_ARGS = dict(max_loras=2, max_lora_rank=8, max_model_len=96, block_size=4, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)


def start(model_dir):
    handle = CoreHandle.start(EngineConfig(model=str(model_dir), **ENGINE_ARGS))
    clients: list[AsyncLLM] = []

    def connect(name: str) -> AsyncLLM:
        client = AsyncLLM.connect(handle.addresses, name, startup_timeout_s=120)
        clients.append(client)
        return client

    def stop() -> None:
        for client in clients:
            client.shutdown()
        pid = handle.pid
        handle.shutdown()
        kill_quietly(pid)

    return handle, connect, stop


@pytest.fixture(scope="module")
def core(text_model_dir):
    """One core for the tests that leave it serving."""
    handle, connect, stop = start(text_model_dir)
    try:
        yield handle, connect
    finally:
        stop()


async def collect(llm: AsyncLLM, prompt, params, request_id):
    return [d async for d in llm.generate(prompt, params, request_id)]


def token_ids(deltas) -> list[int]:
    return [t for d in deltas for c in d.outputs for t in c.token_ids]


async def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_each_client_gets_its_own_outputs_and_aborts_only_its_own(core):
    _, connect = core
    first, second = connect("fe-0-a"), connect("fe-1-a")

    async def run():
        same = await asyncio.gather(
            collect(first, [5, 6, 7, 8], GREEDY, "a-1"),
            collect(second, [5, 6, 7, 8], GREEDY, "b-1"),
            collect(second, [9, 10, 11], GREEDY, "b-2"),
        )
        # A client cannot abort another's request: the second's abort of "a-long" is ignored.
        long = asyncio.create_task(collect(first, [5, 6, 7], LONG, "a-long"))
        await wait_until(lambda: first.stats().num_running == 1)
        await second.abort("a-long")
        # An id another client is using is refused for the second client alone.
        duplicate = await collect(second, [3, 4], GREEDY, "a-long")
        return same, await long, duplicate

    (a1, b1, b2), long, duplicate = asyncio.run(run())
    assert token_ids(a1) == token_ids(b1) and len(token_ids(a1)) == 10  # same prompt, same greedy tokens
    assert len(token_ids(b2)) == 10 and token_ids(b2) != token_ids(b1)
    assert long[-1].outputs[0].finish_reason == "length" and len(token_ids(long)) == 80
    assert "already in use" in duplicate[-1].error


@pytest.mark.slow
def test_a_client_that_goes_away_has_its_requests_aborted(core):
    handle, connect = core
    staying, leaving = connect("fe-0-stay"), connect("fe-1-leave")

    async def run():
        started = asyncio.Event()

        async def stream():
            async for _ in leaving.generate([5, 6, 7], LONG, "orphan"):
                started.set()

        task = asyncio.create_task(stream())
        await asyncio.wait_for(started.wait(), 30)
        leaving._client.close()  # its sockets close as a killed process's would; no abort is sent
        await wait_until(lambda: staying.stats().num_running == 0)
        task.cancel()
        # ClientGone (sent by whoever watches the front-end processes) works too, for a client that idles.
        idle = connect("fe-2-idle")
        quiet = asyncio.create_task(collect(idle, [5, 6, 7], LONG, "quiet"))
        await wait_until(lambda: staying.stats().num_running == 1)
        handle.send(ClientGone("fe-2-idle"))
        await wait_until(lambda: staying.stats().num_running == 0)
        quiet.cancel()
        return await collect(staying, [9, 10], GREEDY, "after")

    after = asyncio.run(run())
    assert len(token_ids(after)) == 10  # the core serves on


@pytest.mark.slow
def test_the_core_dying_ends_the_streams_of_every_client(text_model_dir):
    handle, connect, stop = start(text_model_dir)
    clients = [connect("fe-0-x"), connect("fe-1-x")]  # each watches the core through a pidfd
    pid = handle.pid

    async def run():
        started = [asyncio.Event() for _ in clients]

        async def stream(client, index):
            async for _ in client.generate([5, 6, 7], LONG, f"s{index}"):
                started[index].set()

        tasks = [asyncio.create_task(stream(c, i)) for i, c in enumerate(clients)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    try:
        results = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert all(c.dead_error is not None for c in clients)
        assert wait_gone(pid, 5)
    finally:
        stop()
