"""The typed messages between the front end (the HTTP process) and the engine core process.

Every message is a msgspec Struct of a tagged union, msgpack-encoded: nothing is pickled, and no tensor
crosses (token ids and logprobs travel as plain lists). Inputs go front end -> core, outputs core ->
front end, each over its own socket. The core serves one or several front ends ("clients", each with a
routing id of its own; docs/PROCESSES.md): it binds a ZeroMQ ROUTER per direction, and a client's
DEALERs connect to both. The first message on a client's output socket is its ClientHello; the core
answers it with CoreReady, and from then on sends that client the deltas of the requests it added:

    front end (client "fe-0-1234")                   core
      AddRequest / AbortRequests /      -- inputs -->    schedule -> execute -> update
      ForgetAdapter / PreloadAdapters /    (ROUTER)
      UnpinAdapters / ShutdownCore
      ClientHello (once)                -- outputs ->
      CoreReady (once) / StepOutputs    <-- outputs --   (one StepOutputs per step, per client)
      (one per step) / CoreFailed          (ROUTER)

The core sees only what token-level work needs: one sequence per request (the front end fans `n > 1`
out into `n` requests, each with its own seed), token ids, and the stops it can decide from token ids
alone (max_tokens, eos, stop_token_ids, min_tokens, a finished structured output). Text, stop strings
and logprob formatting stay in the front end.
"""

from __future__ import annotations

import msgspec

from engine.outputs import RequestTimes
from engine.prompt_logprobs import PromptTokenLogprobs
from engine.request_meta import RequestMeta
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

# -- front end -> core ----------------------------------------------------------------------------


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str  # unique among the core's unfinished requests (a child id "req#1" for n > 1)
    prompt_token_ids: list[int]
    # One child's params (n == 1, no stop strings): the engine's own dataclass, every field typed, checked
    # again by its __post_init__ when decoded, so no field list is kept twice.
    params: SamplingParams
    adapter: str | None = None  # an adapter id or name the core's adapter source resolves; None: base model
    # Tenant, weight, priority, cache salt: checked by its __post_init__ when decoded (LLMEngine.add_request)
    meta: RequestMeta = msgspec.field(default_factory=RequestMeta)
    counts_prompt: bool = True  # False for an n > 1 request's later children: its prompt is counted once


class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]  # unknown or finished ids are ignored


class ForgetAdapter(msgspec.Struct, frozen=True, tag="forget"):
    adapter_id: str  # deleted: no new requests; queued ones fail; running ones finish


class PreloadAdapters(msgspec.Struct, frozen=True, tag="preload"):
    adapter_ids: list[str]  # bring in before any request needs them (best effort)
    level: str = "cpu"  # "cpu": the CPU tier; "gpu": a GPU slot (LLMEngine.preload_adapters)
    pin: bool = False  # with "gpu": keep the slot until UnpinAdapters


class UnpinAdapters(msgspec.Struct, frozen=True, tag="unpin"):
    adapter_ids: list[str]  # drop an operator's pin (LLMEngine.unpin_adapters)
    unload: bool = False  # also free their slots and CPU-tier rows when no request holds them


class ShutdownCore(msgspec.Struct, frozen=True, tag="shutdown"):
    """Stop the loop, the adapter loaders and the process (exit code 0)."""


class ClientHello(msgspec.Struct, frozen=True, tag="hello"):
    """A client's first message, on its output socket: the route for its outputs exists; the core
    answers with CoreReady (once the model has loaded) and sends it its requests' deltas from then on."""


class ClientGone(msgspec.Struct, frozen=True, tag="client_gone"):
    """A front-end process died (sent by whoever watches it): abort every request it added."""

    client_id: str  # the dead client's routing id


CoreInput = (
    AddRequest
    | AbortRequests
    | ForgetAdapter
    | PreloadAdapters
    | UnpinAdapters
    | ShutdownCore
    | ClientHello
    | ClientGone
)

# -- core -> front end ----------------------------------------------------------------------------


class RequestDelta(msgspec.Struct, frozen=True, array_like=True):
    """What one request gained in one step. The last delta of a request has `finish_reason` set."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for them
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | None = None  # the stop token id that ended it; None for eos and length
    error: str | None = None  # why it failed (finish_reason "error"), naming the problem
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With params.prompt_logprobs: one entry per prompt token (None for the first), in a request's first delta
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    times: RequestTimes | None = None  # in the first and last deltas: the request's time in the core so far
    error_code: str | None = None  # with `error`, when the request's own data failed it (Request.error_code)


class CoreReady(msgspec.Struct, frozen=True, tag="ready"):
    """Sent once, after the model loaded: what the front end needs to know about the engine."""

    max_model_len: int
    eos_token_ids: list[int]
    stats: EngineStats


# (event, tier, seconds): the adapter manager's observer calls (engine.lora.manager.Observer).
AdapterEvent = tuple[str, str, float]
# (hook, args): what an adapter source recorded (StoreAdapterSource.drain), for its `replay` in the front end.
SourceRecord = tuple[str, list[str | int | float]]


class StepOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    """One engine step's results for one client (or a changed stats snapshot).

    `stats` is an EngineStats already msgpack-encoded (`encode_stats`): the core encodes a step's
    snapshot once for every client, and a client decodes it (`decode_stats`) only when something reads
    it. Adapter events and source records go to one client only (the metrics add up across processes).
    """

    deltas: list[RequestDelta]
    stats: msgspec.Raw
    adapter_events: list[AdapterEvent] = []
    source_records: list[SourceRecord] = []


class CoreFailed(msgspec.Struct, frozen=True, tag="failed"):
    """The core cannot go on (start-up failed, or the loop hit an engine bug); the process exits next."""

    message: str


CoreOutput = CoreReady | StepOutputs | CoreFailed

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)
_stats_decoder = msgspec.msgpack.Decoder(EngineStats)


def encode(message: CoreInput | CoreOutput) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes) -> CoreInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> CoreOutput:
    return _output_decoder.decode(data)


def encode_stats(stats: EngineStats) -> msgspec.Raw:
    return msgspec.Raw(_encoder.encode(stats))


def decode_stats(raw: msgspec.Raw) -> EngineStats:
    return _stats_decoder.decode(raw)
