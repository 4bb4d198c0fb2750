"""KV events: vLLM's `kv_events_config`, its message layout, and a stream that rebuilds the prefix cache.

A consumer written from vLLM's published schema (tests/kv_events_consumer.py, the `msgpack` package,
no engine import) follows a real ZeroMQ PUB socket, fills what it missed from the replay ROUTER socket,
and rebuilds the set of cached block hashes, which must equal the block pool's after every phase:
shared prefixes, two adapters, evictions of a small cache, aborts and a reset.
"""

from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest
from kv_events_consumer import Consumer, decode_batch

from engine import AsyncLLM, EngineConfig, LLMEngine, SamplingParams
from engine.kv_cache import KVCacheManager
from engine.kv_events import KVEventRecorder, KVEventsConfig
from engine.kv_events.wire import KVEventBatch
from engine.lora.router_names import lora_int_id, router_name
from engine.request import Request

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def as_published(digests) -> set[int]:
    """Block digests as vLLM publishes them: the last 8 bytes, big-endian."""
    return {int.from_bytes(d[-8:], "big") for d in digests}


# -- the config ------------------------------------------------------------------------------------


def test_config_takes_vllms_keys_and_defaults():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.replay_endpoint) == ("zmq", "tcp://*:5557", None)
    assert (config.buffer_steps, config.hwm, config.max_queue_size, config.topic) == (
        10_000,
        100_000,
        100_000,
        "",
    )
    assert config.publishes and config.event_encoding == "array"
    assert KVEventsConfig.parse({}).publisher == "null" and not KVEventsConfig.parse({}).publishes
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).publishes
    assert (
        EngineConfig(model="m", kv_events_config='{"enable_kv_cache_events": true}').kv_events_config
        == config
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"enable_kv_cache_events": true, "endpont": "x"}', "unknown keys ['endpont']"),
        ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"endpoint": "5557"}', "ZeroMQ address"),
        ('{"buffer_steps": -1}', "buffer_steps must be an integer >= 0"),
        ('{"max_queue_size": 0}', "max_queue_size must be an integer >= 1"),
        ('{"enable_kv_cache_events": "yes"}', "true or false"),
        ('{"event_encoding": "json"}', "event_encoding must be one of array, map"),
        ("not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_config_refuses_what_it_cannot_use(raw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KVEventsConfig.parse(raw)


# -- the layout, on the KV cache manager alone -------------------------------------------------------


def step(manager: KVCacheManager, request: Request) -> None:
    num_new = request.num_tokens - request.num_computed_tokens
    hits, _ = manager.get_computed_blocks(request) if request.num_computed_tokens == 0 else ([], 0)
    num_new -= len(hits) * BLOCK_SIZE
    assert manager.allocate_slots(request, num_new, hits) is not None
    request.num_computed_tokens += len(hits) * BLOCK_SIZE + num_new


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_events_follow_vllms_layout_and_replay_the_pool(encoding):
    """Decoded by msgpack from what the publisher would send: positional batches; positional or tagged-map
    events; the stored tokens, parent links, adapter names and removals are the pool's."""
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=True)
    recorder = KVEventRecorder(BLOCK_SIZE, encoding)
    manager.record_events(recorder)
    encoder = msgspec.msgpack.Encoder()
    state: set[int] = set()

    def publish_and_check() -> list:
        payload = encoder.encode(KVEventBatch(ts=1.0, events=recorder.take(), data_parallel_rank=0))
        ts, events, rank = decode_batch(payload)
        assert (ts, rank) == (1.0, 0)
        for event in events:
            if event.kind == "BlockStored":
                state.update(event.fields["block_hashes"])
            elif event.kind == "BlockRemoved":
                state.difference_update(event.fields["block_hashes"])
            else:
                state.clear()
        assert state == as_published(manager.block_pool.cached_hashes())
        return events

    first = Request("first", list(range(10)), GREEDY, adapter_id="alpha/support@3")
    step(manager, first)
    (stored,) = publish_and_check()
    assert stored.kind == "BlockStored"
    assert stored.fields["token_ids"] == list(range(8)) and stored.fields["block_size"] == BLOCK_SIZE
    assert stored.fields["parent_block_hash"] is None and len(stored.fields["block_hashes"]) == 2
    assert stored.fields["lora_name"] == "alpha/support" == router_name("alpha/support@3")
    assert stored.fields["lora_id"] == lora_int_id("alpha/support@3") and stored.fields["medium"] == "GPU"
    first_hashes = stored.fields["block_hashes"]

    # the same prefix: two blocks hit, one more stored, chained to the second
    second = Request("second", [*range(12), 40], GREEDY, adapter_id="alpha/support@3")
    step(manager, second)
    (stored,) = publish_and_check()
    assert stored.fields["parent_block_hash"] == first_hashes[1]
    assert stored.fields["token_ids"] == [8, 9, 10, 11]
    manager.free(first)
    manager.free(second)
    assert publish_and_check() == []  # freed blocks keep their hashes: nothing changes for a router

    # a base-model request takes every free block: the oldest cached ones are evicted first
    base = Request("base", list(range(100, 121)), GREEDY)
    step(manager, base)
    removed, stored = publish_and_check()
    assert removed.kind == "BlockRemoved" and len(removed.fields["block_hashes"]) == 3
    assert stored.fields["lora_name"] is None and stored.fields["lora_id"] is None
    assert stored.fields["token_ids"] == list(range(100, 120))
    manager.free(base)
    assert manager.reset_prefix_cache()
    (cleared,) = publish_and_check()
    assert cleared.kind == "AllBlocksCleared" and state == set()


def test_a_block_whose_hash_is_taken_splits_the_stored_run():
    """Two requests compute the same prefix in one step: the second's copies stay unregistered, so only its
    own later block is stored, chained to the first's hash."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=True)
    recorder = KVEventRecorder(BLOCK_SIZE)
    manager.record_events(recorder)
    one = Request("one", list(range(9)), GREEDY)
    two = Request("two", [*range(8), 7, 7, 7, 7, 1], GREEDY)
    assert manager.allocate_slots(one, one.num_tokens) is not None
    assert manager.allocate_slots(two, two.num_tokens) is not None  # no hits asked: computes its own copy
    first, second = recorder.take()
    assert len(first.block_hashes) == 2 and first.parent_block_hash is None
    assert len(second.block_hashes) == 1 and second.parent_block_hash == first.block_hashes[1]
    assert second.token_ids == [7, 7, 7, 7]


# -- through the engine and a real socket ------------------------------------------------------------


@pytest.fixture
def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def test_the_stream_rebuilds_the_engines_prefix_cache(text_model_dir, text_adapters, endpoints):
    """The engine connects to a consumer that binds (llm-d's central indexer mode) on loopback; the
    consumer's state equals the pool's after each phase, and the replay returns exactly the missed
    batches."""
    endpoint, replay = endpoints
    consumer = Consumer(endpoint, replay, topic=b"kv@", bind=True)
    config = EngineConfig(
        model=str(text_model_dir),
        max_loras=2,
        max_lora_rank=8,
        block_size=BLOCK_SIZE,
        max_model_len=48,
        num_kv_blocks=14,
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": "kv@replica-0@tiny",
        },
    )
    engine = LLMEngine(config, skip_tokenizer_init=True)
    try:
        for name, path in text_adapters.items():
            engine.register_adapter(name, str(path))
        shared = list(range(20, 32))

        def run(requests) -> None:
            for request_id, prompt, adapter in requests:
                engine.add_request(request_id, prompt, GREEDY, adapter)
            while engine.has_unfinished_requests():
                engine.step()

        def check() -> None:
            consumer.settle()
            consumer.fill_gaps()
            assert consumer.cached_hashes() == as_published(engine.kv_cache.block_pool.cached_hashes())

        run([("a", [*shared, 1, 2], "alpha"), ("b", [*shared, 3], "alpha"), ("c", [*shared, 4], "beta")])
        check()
        stored = [e for e in consumer.events() if e.kind == "BlockStored"]
        assert {e.fields["lora_name"] for e in stored} == {"alpha", "beta"}
        assert stored[0].fields["token_ids"][: len(shared)] == shared
        run([(f"fill{i}", list(range(100 + 17 * i, 117 + 17 * i)), None) for i in range(4)])  # evicts
        check()
        assert any(e.kind == "BlockRemoved" for e in consumer.events())
        engine.add_request("aborted", list(range(60, 80)), GREEDY, "beta")
        engine.step()
        engine.abort_request("aborted")
        engine.advance_adapters()  # an idle engine publishes what the abort changed
        check()
        assert engine.reset_prefix_cache()
        check()
        assert consumer.events()[-1].kind == "AllBlocksCleared" and consumer.cached_hashes() == set()
        assert consumer.topics == {b"kv@replica-0@tiny"}

        # a late subscriber's replay from 0: every batch still buffered, in order, as first sent
        replayed = consumer.replay(0)
        assert [n for n, _ in replayed] == sorted(consumer.batches)
        assert all(consumer.batches[n] == payload for n, payload in replayed)
        assert consumer.replay(len(consumer.batches)) == []  # nothing after the last: only the end mark
    finally:
        engine.shutdown()
        consumer.close()


def test_replay_keeps_only_the_last_buffer_steps(text_model_dir, endpoints):
    endpoint, replay = endpoints
    consumer = Consumer(endpoint, replay, bind=True)
    config = EngineConfig(
        model=str(text_model_dir),
        block_size=BLOCK_SIZE,
        max_model_len=48,
        num_kv_blocks=40,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "buffer_steps": 2,
            "event_encoding": "map",
        },
    )
    engine = LLMEngine(config, skip_tokenizer_init=True)
    try:
        for i in range(4):  # one batch each: a prompt of two full blocks, stored in its first step
            engine.add_request(f"r{i}", list(range(10 * i, 10 * i + 9)), SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
        consumer.settle()
        replayed = consumer.replay(0)
        assert [n for n, _ in replayed] == [2, 3]  # the two latest; 0 and 1 have left the buffer
        (stored,) = decode_batch(replayed[1][1])[1]  # tagged maps, decoded by field name
        assert stored.kind == "BlockStored" and stored.fields["token_ids"] == list(range(30, 38))
    finally:
        engine.shutdown()
        consumer.close()


@pytest.mark.slow
def test_the_engine_core_process_publishes(text_model_dir, tmp_path):
    """A server's engine runs in the engine-core process: the config travels there and it binds the
    endpoint (an ipc:// address is bound, as a tcp://*: one is); a consumer connects."""
    endpoint, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    config = EngineConfig(
        model=str(text_model_dir),
        block_size=BLOCK_SIZE,
        max_model_len=48,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay},
    )
    llm = AsyncLLM.from_config(config, startup_timeout_s=120)
    consumer = Consumer(endpoint, replay)
    try:

        async def generate(request_id: str) -> None:
            async for _ in llm.generate(list(range(30, 39)), GREEDY, request_id):
                pass

        for attempt in range(20):  # the first batches may pass before the subscription reaches the core
            asyncio.run(generate(f"r{attempt}"))
            consumer.settle(quiet_s=0.3)
            if consumer.live:
                break
        assert consumer.live, "no batch reached a subscriber of the engine core's socket"
        consumer.fill_gaps()
        first = consumer.events()[0]  # the first prompt's first step stored its two full blocks
        assert first.kind == "BlockStored" and first.fields["token_ids"] == list(range(30, 38))
    finally:
        llm.shutdown()
        consumer.close()
