"""What the scheduler hands the model runner for one step: each request's share of the batch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request


class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) of its all_token_ids.

    A plain slotted class, made once per request per step: a frozen dataclass costs several times more.
    """

    __slots__ = (
        "request",
        "num_new_tokens",
        "start",
        "block_ids",
        "num_tokens",
        "num_spec_tokens",
        "samples",
    )

    def __init__(
        self,
        request: Request,
        num_new_tokens: int,  # tokens computed this step, starting at `start`
        start: int,  # request.num_computed_tokens before this step (KV already in cache up to here)
        block_ids: list[int],  # [num_blocks_needed(start + num_new_tokens)] the whole block table
        # request.num_scheduled_tokens when scheduled (filled in if not given): `samples` must not
        # change when the engine appends this step's token to the request.
        num_tokens: int | None = None,
        # Speculative decoding: the last num_spec_tokens of the step's tokens are request.spec_token_ids,
        # proposals that follow the known tokens; the runner returns logits for each to verify them.
        num_spec_tokens: int = 0,
    ):
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.start = start
        self.block_ids = block_ids
        self.num_tokens = request.num_scheduled_tokens if num_tokens is None else num_tokens
        self.num_spec_tokens = num_spec_tokens
        # True when this step computes the last known token, so the runner must sample one.
        self.samples = start + num_new_tokens - num_spec_tokens == self.num_tokens

    def __repr__(self) -> str:
        return (
            f"ScheduledRequest({self.request.request_id!r}, num_new_tokens={self.num_new_tokens}, "
            f"start={self.start}, num_spec_tokens={self.num_spec_tokens}, samples={self.samples})"
        )


@dataclass
class SchedulerOutput:
    """What the runner computes in one step, and what changed in the scheduler's queues."""

    # Batch order: running (oldest first), then newly admitted. A request registers its blocks in the
    # prefix cache before those that come after it in the batch may hit them (KVCacheManager).
    scheduled: list[ScheduledRequest]
    preempted: list[Request]  # preempted this step; their blocks are already freed
    newly_admitted: list[Request]  # waiting or preempted requests that (re)entered running this step
    num_batched_tokens: int  # sum of num_new_tokens, at most max_num_batched_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
