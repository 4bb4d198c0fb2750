"""One generation request as the scheduler, the KV cache manager and the runner see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request_meta import RequestMeta
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.prompt_logprobs import PromptTokenLogprobs

# Token slot of a request that uses no adapter (see lora_kernels.add_lora).
NO_LORA = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # by value: str hashes are cached, Enum.__hash__ is Python

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, else None."""
        return self.value if self.finished else None


_FINISHED_VALUES = frozenset(
    status.value
    for status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


@dataclass(eq=False)
class Request:
    """Token state of one sequence.

    `num_computed_tokens` counts tokens whose KV is in the cache. A request samples a new token in a
    step only when that step computes its last known token; until then (chunked prefill) it only fills
    KV. Preemption drops its blocks and sets `num_computed_tokens` back to 0, so the prompt and the
    tokens generated so far are recomputed when it runs again.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Identity of the adapter's weights (e.g. "tenant/name@3" or a folder path); None: the base model.
    # It is part of every prefix-cache hash, since the same tokens under two adapters have different KV.
    adapter_id: str | None = None
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Tenant, weight, priority, cache salt (engine/request_meta.py): what the scheduler, its policy and
    # the prefix cache read besides the tokens. The server salts the cache with the tenant; offline
    # requests are unsalted unless they ask (vLLM's cache_salt).
    meta: RequestMeta = field(default_factory=RequestMeta)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    error: str | None = None
    # With `error`, when the request's own data is at fault (the API answers 400 with it): e.g.
    # "structured_output_unsatisfiable". None: the engine's side failed.
    error_code: str | None = None
    # Set by the engine while the request's structured-output grammar compiles: the scheduler passes it
    # over until then (engine/structured_output/matchers.py).
    grammar_pending: bool = False
    # Set by the engine when the request is scheduled: the GPU slot holding its adapter, or NO_LORA.
    lora_slot: int = NO_LORA
    # Set by the engine on arrival: None if its adapter was already in a GPU slot, else the adapter's
    # cold start (engine/lora/cold_starts.ColdStart), which labels its TTFT by the tier it came from.
    adapter_cold: object = None
    # Tokens sampled on the device whose ids the host has not read yet (async scheduling: at most 1).
    # The scheduler counts them as known tokens; the runner reads their ids on the device.
    num_in_flight: int = 0
    # Set by the engine (time.monotonic): first admitted to the batch, first token read back. With
    # arrival_time they give vLLM's queue, prefill, decode and inference times.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # Speculative decoding: tokens proposed to follow all_token_ids, verified in the next step that
    # schedules this request (engine/spec_decode/); the scheduler trims them to what it schedules.
    spec_token_ids: list[int] = field(default_factory=list)

    # prompt + output, kept as one list so the runner slices it without copying both (set here).
    all_token_ids: list[int] = field(init=False)
    # With params.prompt_logprobs: one entry per prompt token so far, None for token 0 (set here, filled
    # by the engine from the runner's prefill steps, engine/prompt_logprobs.py); else None.
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt has no tokens")
        self.all_token_ids = list(self.prompt_token_ids)
        self.prompt_logprobs = [None] if self.sampling_params.prompt_logprobs is not None else None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprob entries are still missing (prefill must compute every position)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the scheduler can plan with: the known ones and those still in flight."""
        return len(self.all_token_ids) + self.num_in_flight

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
