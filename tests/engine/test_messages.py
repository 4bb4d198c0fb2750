"""The core's messages round-trip through msgpack unchanged, and a wrong message is refused, not guessed."""

from __future__ import annotations

import msgspec
import pytest

from engine import EngineStats, SamplingParams
from engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreSamplingParams,
    ForgetAdapter,
    RequestDelta,
    ShutdownCore,
    StepOutputs,
    decode_input,
    decode_output,
    encode,
)
from engine.sampler import TokenLogprobs

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
)
PARAMS = SamplingParams(
    n=3, max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=11, stop=["x"], stop_token_ids=[4],
    ignore_eos=True, logprobs=2, min_tokens=1,
)  # fmt: skip


@pytest.mark.parametrize(
    "message",
    [
        AddRequest("r1#0", [1, 2, 3], CoreSamplingParams.of(PARAMS), "acme/a@1"),
        AddRequest("r2", [7], CoreSamplingParams.of(SamplingParams()), None),
        AbortRequests(["r1#0", "r1#1"]),
        ForgetAdapter("acme/a@1"),
        ShutdownCore(),
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
            ],
            stats=STATS,
            adapter_events=[("miss", "cpu", 0.0), ("load", "gpu", 0.01)],
            source_records=[("event", ["hit", "disk", 0.0]), ("cache_eviction", [1024])],
        ),
        CoreFailed("RuntimeError: CUDA error"),
    ],
)
def test_outputs_round_trip(message):
    assert decode_output(encode(message)) == message


def test_core_params_keep_what_the_core_needs_and_nothing_else():
    params = CoreSamplingParams.of(PARAMS).to_params()
    assert params.n == 1 and params.stop == []  # fan-in and stop strings stay in the front end
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"):
        assert getattr(params, name) == getattr(PARAMS, name), name
    assert (params.logprobs, params.min_tokens) == (2, 1)


def test_an_output_on_the_input_socket_is_refused():
    with pytest.raises(msgspec.ValidationError):
        decode_input(encode(CoreFailed("not an input")))
    with pytest.raises(msgspec.ValidationError):
        decode_output(encode(AddRequest("r", [1], CoreSamplingParams.of(SamplingParams()))))


def test_no_tensor_or_pickle_can_travel():
    import torch

    with pytest.raises(TypeError):
        encode(AddRequest("r", torch.tensor([1, 2]), CoreSamplingParams.of(SamplingParams())))
