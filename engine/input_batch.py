"""The step's model inputs, kept in persistent host buffers and updated by diffs.

A request owns a row while it is scheduled step after step: its block table row and adapter slot stay in
place, and a step writes only what changed (a new request's row, the blocks appended since the last step)
plus the values every row changes (input token, position, KV slot, length), computed with a few vector
operations instead of Python lists. Rows follow the batch order; when requests leave (finished,
preempted, or just not scheduled) the others move up in one gather, and a request that comes back (or
was preempted meanwhile: its blocks are new) gets its row written afresh. Example, block_size 4:

    rows after the last step:  r0 = A [7, 2]   r1 = B [5]   r2 = C [9]
    this step schedules A, C, D: B left, D is new with blocks [3, 4], C grew to [9, 6]
        gather    block_table[[0, 1]] = block_table[[0, 2]]     (A stays, C moves up)
        new row   block_table[2, :2] = [3, 4]                   (D)
        diff      block_table[1, 1] = 6                         (C's one new block)

Each step then fills page-locked host buffers (step_buffers.py) and copies each one to the device once,
without blocking the host: decode steps into the CUDA graphs' static buffers, padding rows included,
other steps into buffers of their own.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.model.attention import AttentionMetadata
from engine.request import NO_LORA, Request
from engine.sampler import SampledStep, on_device
from engine.scheduler_output import ScheduledRequest
from engine.step_buffers import DecodeTwins, EagerTwins


class InputBatch:
    """Rows of the running requests (host side) and the twins their inputs are sent through."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
    ):
        self.block_size = block_size
        self.pad_block = pad_block
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), np.int64)  # row -> block ids
        self.num_blocks = np.zeros(max_num_seqs, np.int64)  # block ids written in each row
        self.num_preemptions = np.zeros(max_num_seqs, np.int64)  # the row's request's, when written
        self.lora_slots = np.full(max_num_seqs, NO_LORA, np.int32)
        self.requests: list[Request] = []  # row i holds requests[i]
        self._rows: dict[Request, int] = {}
        self.decode = DecodeTwins(max_num_seqs, max_blocks_per_seq, device)
        self.eager = EagerTwins(max_num_seqs, max_num_tokens, max_blocks_per_seq, device)
        self.device = device
        # Recorded after each step's copies: the host buffers they read are rewritten only after it.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    def reset(self) -> None:
        """Forget every row (after the warm-up's synthetic steps)."""
        self.requests, self._rows = [], {}

    # -- rows -------------------------------------------------------------------------------------------

    def update(self, scheduled: list[ScheduledRequest]) -> None:
        """Make rows [0, len(scheduled)) hold this step's requests, in order, with their whole block tables."""
        requests = [s.request for s in scheduled]
        n = len(requests)
        if n > self.max_num_seqs:
            raise ValueError(f"a step holds at most max_num_seqs={self.max_num_seqs} sequences, got {n}")
        if requests != self.requests:  # identity: Request compares by identity
            old_rows = np.fromiter((self._rows.get(r, -1) for r in requests), np.int64, n)
            self._move_rows(old_rows)
            self.requests = requests
            self._rows = {r: i for i, r in enumerate(requests)}
        preemptions = np.fromiter((r.num_preemptions for r in requests), np.int64, n)
        # A request preempted since its row was written has new blocks: rewrite the row whole.
        self.num_blocks[:n][preemptions != self.num_preemptions[:n]] = 0
        self.num_preemptions[:n] = preemptions
        self.lora_slots[:n] = np.fromiter((r.lora_slot for r in requests), np.int32, n)
        wanted = np.fromiter((len(s.block_ids) for s in scheduled), np.int64, n)
        have = self.num_blocks[:n]
        have[wanted < have] = 0  # never happens while a request stays scheduled; rewrite if it does
        for i in np.flatnonzero(wanted > have):
            first = int(have[i])
            self.block_table[i, first : wanted[i]] = scheduled[i].block_ids[first:]
        self.num_blocks[:n] = wanted

    def _move_rows(self, old_rows: np.ndarray) -> None:
        """Row i takes over old row old_rows[i] (-1: a new request, nothing to keep)."""
        kept = old_rows >= 0
        dest = np.flatnonzero(kept)
        src = old_rows[kept]
        if not np.array_equal(dest, src):
            for array in (self.block_table, self.num_blocks, self.num_preemptions):
                array[dest] = array[src]  # fancy indexing copies the source rows first
        self.num_blocks[: len(old_rows)][~kept] = 0

    # -- one step's tensors -----------------------------------------------------------------------------

    def prepare_decode(
        self, scheduled: list[ScheduledRequest], size: int, in_flight: SampledStep | None = None
    ) -> bool:
        """A decode-only step (one new token per row) into the graphs' buffers, rows [n, size) padding
        (one token in the scratch block, no adapter). Input tokens still in flight are read from
        `in_flight` on the device. Returns whether any row uses an adapter."""
        n, bs = len(scheduled), self.block_size
        self._wait_for_copies()
        twins = self.decode
        longs, ints = twins.longs.host_np, twins.ints.host_np
        starts = np.fromiter((s.start for s in scheduled), np.int64, n)
        ids, waiting = _input_ids(scheduled)
        longs[0, :n] = ids
        longs[1, :n] = starts
        longs[2, :n] = self.block_table[np.arange(n), starts // bs] * bs + starts % bs
        ints[0, :n] = starts + 1
        ints[1, :n] = self.lora_slots[:n]
        longs[:, n:size] = 0
        longs[2, n:size] = self.pad_block * bs
        ints[0, n:size] = 1
        ints[1, n:size] = NO_LORA
        width = max(1, int(self.num_blocks[:n].max()))
        table = twins.block_tables.host_np[: size * width].reshape(size, width)
        table[:n] = self.block_table[:n, :width]
        table[n:, 0] = self.pad_block
        twins.send(size, width)
        self._record_copies()
        _read_in_flight(twins.input_ids, waiting, in_flight)
        return bool((self.lora_slots[:n] != NO_LORA).any())

    def prepare_eager(
        self,
        scheduled: list[ScheduledRequest],
        in_flight: SampledStep | None = None,
        pad_to: int | None = None,
    ):
        """Any step: (input_ids [num_tokens], AttentionMetadata, token slots [num_tokens] int32 or None when
        no token uses an adapter, logits rows [num_sampling_rows] of the rows that sample). Input tokens
        still in flight are read from `in_flight` on the device. `pad_to` (piecewise graphs): the device
        buffers also get padding rows [num_tokens, pad_to): token 0 at position 0 in the scratch block,
        no adapter."""
        n, bs = len(scheduled), self.block_size
        self._wait_for_copies()
        twins = self.eager
        longs, ints = twins.longs.host_np, twins.ints.host_np
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        starts = np.fromiter((s.start for s in scheduled), np.int64, n)
        query_start_loc = ints[1, : n + 1]
        query_start_loc[0] = 0
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[n])
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"a step holds at most {self.max_num_tokens} tokens, got {num_tokens}")
        ints[0, :n] = starts + num_new  # sequence lengths
        rows = np.repeat(np.arange(n), num_new)  # [num_tokens] the row of each token
        positions = np.arange(num_tokens) + np.repeat(starts - query_start_loc[:n], num_new)
        ids, waiting = _input_ids(scheduled)
        longs[0, :num_tokens] = ids
        longs[1, :num_tokens] = positions
        longs[2, :num_tokens] = self.block_table[rows, positions // bs] * bs + positions % bs
        use_lora = bool((self.lora_slots[:n] != NO_LORA).any())
        if use_lora:
            twins.token_slots.host_np[:num_tokens] = self.lora_slots[rows]
        rows_sent = num_tokens
        if pad_to is not None:
            if pad_to < num_tokens or pad_to > self.max_num_tokens:
                raise ValueError(
                    f"cannot pad {num_tokens} tokens to {pad_to} (at most {self.max_num_tokens})"
                )
            longs[:2, num_tokens:pad_to] = 0
            longs[2, num_tokens:pad_to] = self.pad_block * bs
            twins.token_slots.host_np[num_tokens:pad_to] = NO_LORA
            rows_sent = pad_to
        sampling_rows = _logits_rows(scheduled, query_start_loc[1:])
        twins.logits_rows.host_np[: len(sampling_rows)] = sampling_rows
        width = max(1, int(self.num_blocks[:n].max()))
        twins.block_tables.host_np[: n * width].reshape(n, width)[:] = self.block_table[:n, :width]
        meta = AttentionMetadata(
            positions=twins.longs.device[1, :num_tokens],
            slot_mapping=twins.longs.device[2, :num_tokens],
            block_tables=twins.block_tables.device[: n * width].view(n, width),
            query_start_loc=query_start_loc.tolist(),
            seq_lens=ints[0, :n].tolist(),
            seq_lens_tensor=twins.ints.device[0, :n],
            query_start_loc_tensor=twins.ints.device[1, : n + 1],
        )
        twins.send(rows_sent, n * width, len(sampling_rows), use_lora)
        self._record_copies()
        _read_in_flight(twins.longs.device[0], waiting, in_flight)
        token_slots = twins.token_slots.device[:num_tokens] if use_lora else None
        return (
            twins.longs.device[0, :num_tokens],
            meta,
            token_slots,
            twins.logits_rows.device[: len(sampling_rows)],
        )

    def prepare_lanes(
        self,
        scheduled: list[ScheduledRequest],
        twins,
        size: int,
        lane: int,
        in_flight: SampledStep | None = None,
    ) -> tuple[bool, int]:
        """A step of 1 to `lane` new tokens per request into the verification graphs' buffers (`twins`,
        spec_decode/verify_graphs.py): request i's tokens at rows [i * lane, i * lane + num_new), ghost
        rows after them and padding lanes up to `size`. Input tokens still in flight are read from
        `in_flight` on the device. Returns (whether any row uses an adapter, the
        number of logits rows)."""
        n, bs = len(scheduled), self.block_size
        rows = size * lane
        self._wait_for_copies()
        longs, token_slots = twins.longs.host_np, twins.token_slots.host_np
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        starts = np.fromiter((s.start for s in scheduled), np.int64, n)
        real = np.tile(np.arange(lane), n) < np.repeat(num_new, lane)  # [n * lane]
        dest = np.flatnonzero(real)  # [num_tokens] lane row of each real token, in step order
        owner = np.repeat(np.arange(n), num_new)  # [num_tokens] its request's row
        positions = dest - owner * lane + starts[owner]
        ids, waiting = _input_ids(scheduled)
        longs[:, :rows] = 0  # ghosts: token 0 at position 0
        longs[2, :rows] = self.pad_block * bs
        longs[0, dest] = ids
        longs[1, dest] = positions
        longs[2, dest] = self.block_table[owner, positions // bs] * bs + positions % bs
        token_slots[:rows] = NO_LORA
        token_slots[dest] = self.lora_slots[owner]
        seq_lens = twins.seq_lens.host_np
        seq_lens[:n] = starts + lane  # the kernel's context (seq_len - lane) is the lane's start
        seq_lens[n:size] = lane
        width = int(-(-seq_lens[:size].max() // bs))
        table = twins.block_tables.host_np[: size * width].reshape(size, width)
        table[:] = self.pad_block
        known = min(width, self.block_table.shape[1])
        table[:n, :known] = self.block_table[:n, :known]
        # Keys a ghost may read past the request's blocks: the scratch block, never a stale id.
        table[:n][np.arange(width)[None, :] >= self.num_blocks[:n, None]] = self.pad_block
        sampling_rows = _logits_rows(scheduled, np.arange(n) * lane + num_new)
        twins.logits_rows.host_np[: len(sampling_rows)] = sampling_rows
        twins.send(size, lane, width, len(sampling_rows))
        self._record_copies()
        waiting = [(int(dest[position]), request) for position, request in waiting]
        _read_in_flight(twins.longs.device[0], waiting, in_flight)
        return bool((self.lora_slots[:n] != NO_LORA).any()), len(sampling_rows)

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _record_copies(self) -> None:
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))


def _input_ids(scheduled: list[ScheduledRequest]) -> tuple[list[int], list[tuple[int, Request]]]:
    """The step's input tokens in order, 0 for a token still in flight (async scheduling: the last
    sampled token, computed alone in its row), and (position in the step, request) of each such token.
    Speculative proposals follow a request's known tokens."""
    ids: list[int] = []
    waiting: list[tuple[int, Request]] = []
    for s in scheduled:
        num_known = s.num_new_tokens - s.num_spec_tokens
        known = s.request.all_token_ids[s.start : s.start + num_known]
        ids.extend(known)
        missing = num_known - len(known)
        if missing:
            if missing > 1:
                raise RuntimeError(f"request {s.request.request_id}: {missing} input tokens in flight")
            waiting.append((len(ids), s.request))
            ids.append(0)
        if s.num_spec_tokens:
            ids.extend(s.request.spec_token_ids[: s.num_spec_tokens])
    return ids, waiting


def _logits_rows(scheduled: list[ScheduledRequest], ends: np.ndarray) -> np.ndarray:
    """Token rows whose logits the step returns: the last known token of each request that samples, and
    each of its speculative proposals after it. Example, ends (query end offsets) [3, 4, 9]: request 0
    prefills (no sampling), 1 decodes, 2 verifies 4 proposals -> rows [3, 4, 5, 6, 7, 8]."""
    n = len(scheduled)
    samples = np.fromiter((s.samples for s in scheduled), bool, n)
    num_spec = np.fromiter((s.num_spec_tokens for s in scheduled), np.int64, n)
    counts = np.where(samples, 1 + num_spec, 0)  # [n] rows per request
    if not num_spec.any():
        return ends[samples] - 1
    total = int(counts.sum())
    firsts = np.repeat(ends - counts, counts)  # [total] first row of each request, repeated
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)  # 0..count-1 per request
    return firsts + offsets


def _read_in_flight(
    input_ids: torch.Tensor, waiting: list[tuple[int, Request]], in_flight: SampledStep | None
) -> None:
    """Write the in-flight tokens into the step's input ids on the device (after the host's copy)."""
    if not waiting:
        return
    if in_flight is None:
        raise RuntimeError("a step reads tokens still in flight, but no in-flight step was given")
    row_of = in_flight.row_of()
    positions = [p for p, _ in waiting]
    rows = [row_of[request] for _, request in waiting]
    if positions == rows == list(range(len(rows))):  # the steady state: the same requests, same order
        input_ids[: len(rows)].copy_(in_flight.token_ids[: len(rows)])
        return
    device = input_ids.device
    input_ids[on_device(positions, device)] = in_flight.token_ids[on_device(rows, device)]
