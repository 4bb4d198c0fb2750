"""The core's messages round-trip through msgpack unchanged, and a wrong message is refused, not guessed."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from engine import EngineStats, RequestMeta, SamplingParams
from engine.messages import (
    AbortRequests,
    AddRequest,
    ClientGone,
    ClientHello,
    CoreFailed,
    CoreReady,
    ForgetAdapter,
    RequestDelta,
    ShutdownCore,
    StepOutputs,
    decode_input,
    decode_output,
    decode_stats,
    encode,
    encode_stats,
)
from engine.outputs import RequestTimes
from engine.prompt_logprobs import PromptTokenLogprobs
from engine.sampler import TokenLogprobs
from engine.spec_decode.stats import SpecDecodeStats

STATS = EngineStats(
    num_running=2,
    num_waiting=1,
    kv_cache_usage=0.25,
    num_preemptions=3,
    num_prompt_tokens=40,
    num_generation_tokens=17,
    running_adapters=("acme/a@1", "acme/b@2"),
    waiting_adapters=("beta/c@1",),
    max_loras=4,
    num_lora_slots_in_use=2,
    num_adapters_loading=1,
    spec_decode=SpecDecodeStats(3, 9, 5, (3, 2, 0)),
)
PARAMS = SamplingParams(
    max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=-(2**63), stop_token_ids=[4], ignore_eos=True,
    logprobs=2, min_tokens=1, structured_outputs={"json": {"type": "object"}}, repetition_penalty=1.1,
    presence_penalty=-0.5, frequency_penalty=0.25, logit_bias={7: -100.0, 8: 2.5}, allowed_token_ids=[1, 2, 7],
    min_p=0.05, skip_special_tokens=False, prompt_logprobs=3, speculative=False,
)  # fmt: skip


@pytest.mark.parametrize(
    "message",
    [
        AddRequest(
            "r1#0",
            [1, 2, 3],
            PARAMS,
            "acme/a@1",
            meta=RequestMeta(tenant="acme", tenant_weight=2.5, priority=-(2**63), cache_salt="s\x00é"),
        ),
        AddRequest("r2", [7], SamplingParams(structured_outputs={"choice": ["yes", "no"]}), None),
        AbortRequests(["r1#0", "r1#1"]),
        ForgetAdapter("acme/a@1"),
        ShutdownCore(),
        ClientHello(),
        ClientGone("fe-1-4242"),
    ],
)
def test_inputs_round_trip(message):
    assert decode_input(encode(message)) == message


@pytest.mark.parametrize(
    "message",
    [
        CoreReady(max_model_len=128, eos_token_ids=[0, 5], stats=STATS),
        StepOutputs(
            deltas=[
                RequestDelta("r1", [5], [TokenLogprobs(5, -0.25, {5: -0.25, 9: -1.5})]),
                RequestDelta("r2", [0], finish_reason="stop", stop_reason=None, num_cached_tokens=8),
                RequestDelta("r3", [], finish_reason="error", error="unknown adapter 'x'"),
                RequestDelta(
                    "r4",
                    [6],
                    prompt_logprobs=[None, PromptTokenLogprobs(3, -1.5, 2, {4: -0.5, 3: -1.5})],
                    times=RequestTimes(queue=0.01, prefill=0.2, decode=0.0, inference=0.2),
                ),
            ],
            stats=encode_stats(STATS),
            adapter_events=[("miss", "cpu", 0.0), ("load", "gpu", 0.01)],
            source_records=[("event", ["hit", "disk", 0.0]), ("cache_eviction", [1024])],
        ),
        CoreFailed("RuntimeError: CUDA error"),
    ],
)
def test_outputs_round_trip(message):
    assert decode_output(encode(message)) == message


def test_step_stats_travel_encoded_once_and_decode_on_demand():
    """The core encodes a step's snapshot once for every client; a client decodes it when read."""
    message = decode_output(encode(StepOutputs(deltas=[], stats=encode_stats(STATS))))
    assert isinstance(message.stats, msgspec.Raw) and decode_stats(message.stats) == STATS


def test_every_sampling_field_crosses_unchanged():
    """The core gets the engine's own SamplingParams: a field added to it travels without a second list."""
    decoded = decode_input(encode(AddRequest("r", [1], PARAMS))).params
    assert dataclasses.asdict(decoded) == dataclasses.asdict(PARAMS)
    assert all(
        getattr(PARAMS, f.name) != f.default
        for f in dataclasses.fields(PARAMS)
        if f.name not in ("n", "stop", "include_stop_str_in_output")
    )


def test_params_the_engine_refuses_do_not_decode():
    raw = msgspec.to_builtins(AddRequest("r", [1], SamplingParams()))
    raw["params"]["max_tokens"] = 0
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        decode_input(msgspec.msgpack.encode(raw))


def test_every_meta_field_crosses_and_a_bad_one_does_not_decode():
    """RequestMeta checks itself when decoded, as SamplingParams does: a new field needs no second list."""
    meta = RequestMeta(tenant="t", tenant_weight=0.5, priority=3, cache_salt="x")
    assert all(getattr(meta, f) != getattr(RequestMeta(), f) for f in RequestMeta.__struct_fields__)
    assert decode_input(encode(AddRequest("r", [1], PARAMS, meta=meta))).meta == meta
    for field, bad in [("tenant", ""), ("tenant_weight", -1.0), ("priority", 1.5), ("cache_salt", "")]:
        raw = msgspec.to_builtins(AddRequest("r", [1], SamplingParams()))
        raw["meta"][field] = bad
        with pytest.raises(msgspec.ValidationError, match=field):
            decode_input(msgspec.msgpack.encode(raw))


def test_an_output_on_the_input_socket_is_refused():
    with pytest.raises(msgspec.ValidationError):
        decode_input(encode(CoreFailed("not an input")))
    with pytest.raises(msgspec.ValidationError):
        decode_output(encode(AddRequest("r", [1], SamplingParams())))


def test_no_tensor_or_pickle_can_travel():
    import torch

    with pytest.raises(TypeError):
        encode(AddRequest("r", torch.tensor([1, 2]), SamplingParams()))
