"""The engine core's loop, run on a thread over in-process sockets: one request's bad data fails that
request alone and the loop serves on; aborts and refusals come back as deltas."""

from __future__ import annotations

import threading
import time
import uuid

import msgspec
import pytest
import zmq

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.core_process.loop import EngineCoreLoop
from engine.lora.residency import AdapterStatus
from engine.messages import (
    AbortRequests,
    AddRequest,
    ClientHello,
    CoreReady,
    PreloadAdapters,
    RequestDelta,
    ShutdownCore,
    StepOutputs,
    decode_output,
    encode,
)

ENGINE_ARGS = dict(max_loras=2, max_lora_rank=8, max_model_len=96, block_size=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {"good-1": [5, 6, 7, 8], "good-2": [9, 10, 11]}


class LoopHarness:
    """An EngineCoreLoop on a thread, with one client; `send` inputs, `collect` deltas until requests finish."""

    def __init__(self, engine: LLMEngine) -> None:
        self.context = zmq.Context()
        name = uuid.uuid4().hex
        self.to_core, core_in = self.context.socket(zmq.DEALER), self.context.socket(zmq.ROUTER)
        core_out, self.from_core = self.context.socket(zmq.ROUTER), self.context.socket(zmq.DEALER)
        for client_socket in (self.to_core, self.from_core):
            client_socket.setsockopt(zmq.ROUTING_ID, b"test-client")
        core_in.bind(f"inproc://in-{name}")
        self.to_core.connect(f"inproc://in-{name}")
        core_out.bind(f"inproc://out-{name}")
        self.from_core.connect(f"inproc://out-{name}")
        self.from_core.send(encode(ClientHello()))
        self._core_sockets = (core_in, core_out)
        self.loop = EngineCoreLoop(engine, core_in, core_out, [])
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:
            self.errors.append(exc)

    def send(self, *messages) -> None:
        for message in messages:
            self.to_core.send(encode(message))

    def collect(self, request_ids: set[str], timeout_s: float = 60) -> dict[str, list[RequestDelta]]:
        deltas: dict[str, list[RequestDelta]] = {}
        deadline = time.monotonic() + timeout_s
        while not all(deltas.get(r) and deltas[r][-1].finish_reason for r in request_ids):
            assert time.monotonic() < deadline and not self.errors, (self.errors, deltas)
            if self.from_core.poll(100):
                message = decode_output(self.from_core.recv())
                assert isinstance(message, (CoreReady, StepOutputs)), message
                for delta in getattr(message, "deltas", []):
                    deltas.setdefault(delta.request_id, []).append(delta)
        return deltas

    def close(self) -> None:
        self.send(ShutdownCore())
        self.thread.join(10)
        for socket in (self.to_core, self.from_core, *self._core_sockets):
            socket.close(linger=0)
        self.context.term()


@pytest.fixture
def harness(text_model_dir, text_adapters):
    engine = LLMEngine(
        EngineConfig(model=str(text_model_dir), **ENGINE_ARGS), skip_tokenizer_init=True, output_kind="delta"
    )
    engine.register_adapter("alpha", str(text_adapters["alpha"]))
    harness = LoopHarness(engine)
    try:
        yield harness
    finally:
        harness.close()
        engine.shutdown()
    assert not harness.thread.is_alive() and not harness.errors


@pytest.fixture(scope="module")
def expected(text_model_dir):
    offline = LLM(model=str(text_model_dir), skip_tokenizer_init=True, **ENGINE_ARGS)
    outputs = offline.generate([{"prompt_token_ids": p} for p in PROMPTS.values()], GREEDY)
    return {name: out.outputs[0].token_ids for name, out in zip(PROMPTS, outputs)}


def add(request_id, prompt, params=GREEDY, adapter=None) -> AddRequest:
    return AddRequest(request_id, prompt, params, adapter)


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def test_a_request_that_breaks_its_step_fails_alone_and_the_loop_serves_on(harness, expected, monkeypatch):
    """A fault injected into one request's sampling at its third token: that request ends with an error,
    the others finish with the offline engine's tokens, and the loop serves the next request."""
    sampler = harness.loop.engine.sampler
    real = sampler._request_generator

    def faulty(request, device):
        if request.sampling_params.seed == 666 and request.num_output_tokens + request.num_in_flight == 2:
            raise RuntimeError("Overflow when unpacking long long")
        return real(request, device)

    monkeypatch.setattr(sampler, "_request_generator", faulty)
    poisoned = SamplingParams(temperature=1.0, seed=666, max_tokens=8, ignore_eos=True)
    harness.send(
        add("good-1", PROMPTS["good-1"]),
        add("poisoned", [3, 4, 5], poisoned, "alpha"),
        add("good-2", PROMPTS["good-2"]),
    )
    deltas = harness.collect({"good-1", "poisoned", "good-2"})
    assert tokens(deltas["good-1"]) == expected["good-1"] and tokens(deltas["good-2"]) == expected["good-2"]
    bad = deltas["poisoned"][-1]
    assert bad.finish_reason == "error" and "Overflow" in bad.error
    assert len(tokens(deltas["poisoned"])) == 2
    harness.send(add("after", PROMPTS["good-2"]))
    assert tokens(harness.collect({"after"})["after"]) == expected["good-2"]


def test_refused_and_aborted_requests_come_back_as_deltas(harness, expected):
    # Params the engine refuses: they do not even decode (the front end validates too, the core checks).
    bad_params = msgspec.to_builtins(add("bad-params", [5, 6]))
    bad_params["params"]["max_tokens"] = 0
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    harness.to_core.send(msgspec.msgpack.encode(bad_params))
    harness.send(
        add("unknown-adapter", [5, 6], adapter="nope"),
        add("long", [5, 6, 7], long),
        add("good-1", PROMPTS["good-1"]),
    )
    refused = harness.collect({"bad-params", "unknown-adapter", "good-1"})
    assert (
        refused["bad-params"][-1].finish_reason == "error" and "max_tokens" in refused["bad-params"][-1].error
    )
    assert refused["bad-params"][-1].error_code == "invalid_request"  # its own data: a 400 upstream
    assert "unknown adapter 'nope'" in refused["unknown-adapter"][-1].error
    assert tokens(refused["good-1"]) == expected["good-1"]
    harness.send(AbortRequests(["long", "never-seen"]))
    deltas = harness.collect({"long"})
    assert deltas["long"][-1].finish_reason == "abort" and len(tokens(deltas["long"])) < 80
    harness.send(add("good-1", PROMPTS["good-1"]))  # the finished id may be used again
    assert tokens(harness.collect({"good-1"})["good-1"]) == expected["good-1"]


def test_preloaded_adapters_reach_the_cpu_tier_while_the_core_is_idle(harness, expected):
    """A server's --lora-modules are loaded at start, not by the first request: the idle loop collects the
    load. An unknown name is skipped with a warning; the adapter then serves as usual."""
    engine = harness.loop.engine
    adapter_id = engine.lora.resolve("alpha")
    assert engine.lora.status(adapter_id) is None  # never asked for yet
    harness.send(PreloadAdapters(["nope", "alpha"]))
    deadline = time.monotonic() + 30
    while engine.lora.status(adapter_id) is not AdapterStatus.CPU:
        assert time.monotonic() < deadline and not harness.errors, engine.lora.status(adapter_id)
        time.sleep(0.02)
    harness.send(add("after", PROMPTS["good-2"], adapter="alpha"))
    done = harness.collect({"after"})["after"]
    assert done[-1].finish_reason == "length" and len(tokens(done)) == GREEDY.max_tokens
