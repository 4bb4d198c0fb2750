"""InputBatch: persistent rows updated by diffs give exactly the inputs that rebuilding them from the
scheduled requests gives, over random sequences of steps (admissions, finishes, preemptions, requests
skipped for a step, block growth, prefill chunks and decodes, adapters on some rows)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.input_batch import InputBatch
from engine.request import NO_LORA, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest

BLOCK_SIZE = 4
MAX_SEQS = 6
MAX_TOKENS = 64
MAX_BLOCKS = 12  # max_model_len 48
PAD_BLOCK = 999


def rebuilt(scheduled: list[ScheduledRequest]) -> dict:
    """The inputs as the runner built them before InputBatch: from Python lists, every step."""
    bs = BLOCK_SIZE
    out = dict(
        input_ids=[], positions=[], slot_mapping=[], query_start_loc=[0], seq_lens=[], lora=[], rows=[]
    )
    for s in scheduled:
        end = s.start + s.num_new_tokens
        out["input_ids"] += s.request.all_token_ids[s.start : end]
        out["positions"] += list(range(s.start, end))
        out["slot_mapping"] += [s.block_ids[p // bs] * bs + p % bs for p in range(s.start, end)]
        out["query_start_loc"].append(out["query_start_loc"][-1] + s.num_new_tokens)
        out["seq_lens"].append(end)
        out["lora"] += [s.request.lora_slot] * s.num_new_tokens
        if s.samples:
            out["rows"].append(out["query_start_loc"][-1] - 1)
    return out


class Simulation:
    """Requests that come, grow, get preempted, skip steps and finish, with real block tables."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.live: list[dict] = []
        self.next_block = 0
        self.next_id = 0

    def _admit(self) -> None:
        prompt = [self.rng.randrange(1, 500) for _ in range(self.rng.randint(1, 20))]
        request = Request(f"r{self.next_id}", prompt, SamplingParams())
        request.lora_slot = self.rng.choice([NO_LORA, 0, 1, 2])
        self.next_id += 1
        self.live.append(dict(request=request, computed=0, blocks=[]))

    def _new_block(self) -> int:
        self.next_block = (self.next_block + self.rng.randint(1, 7)) % 400
        return self.next_block

    def step(self) -> list[ScheduledRequest]:
        rng = self.rng
        for item in list(self.live):
            if rng.random() < 0.1 or item["request"].num_tokens >= MAX_BLOCKS * BLOCK_SIZE - 1:
                self.live.remove(item)  # finished
            elif rng.random() < 0.05:  # preempted: blocks freed, recomputed from token 0
                item["request"].num_preemptions += 1
                item["computed"], item["blocks"] = 0, []
        while len(self.live) < MAX_SEQS and rng.random() < 0.5:
            self._admit()
        chosen = [item for item in self.live if rng.random() < 0.85]
        if rng.random() < 0.2:
            rng.shuffle(chosen)
        scheduled, budget = [], MAX_TOKENS
        for item in chosen:
            request = item["request"]
            left = request.num_tokens - item["computed"]
            if budget == 0:
                break
            num_new = min(left, budget, rng.choice([1, 1, 2, 5, 50]))
            end = item["computed"] + num_new
            while len(item["blocks"]) * BLOCK_SIZE < end:
                item["blocks"].append(self._new_block())
            scheduled.append(ScheduledRequest(request, num_new, item["computed"], list(item["blocks"])))
            item["computed"] = end
            budget -= num_new
        return scheduled

    def after_step(self, scheduled: list[ScheduledRequest]) -> None:
        for s in scheduled:
            if s.samples:
                s.request.append_output_token(self.rng.randrange(1, 500))


@pytest.mark.parametrize("seed", range(6))
def test_persistent_rows_match_rebuilt_inputs(seed):
    batch = InputBatch(MAX_SEQS, MAX_TOKENS, MAX_BLOCKS, BLOCK_SIZE, PAD_BLOCK, torch.device("cpu"))
    sim = Simulation(seed)
    checked_decode = 0
    for _ in range(150):
        scheduled = sim.step()
        if not scheduled:
            continue
        batch.update(scheduled)
        expected = rebuilt(scheduled)
        ids, meta, token_slots, rows = batch.prepare_eager(scheduled)
        assert ids.tolist() == expected["input_ids"]
        assert meta.positions.tolist() == expected["positions"]
        assert meta.slot_mapping.tolist() == expected["slot_mapping"]
        assert meta.query_start_loc == expected["query_start_loc"]
        assert meta.seq_lens == expected["seq_lens"]
        assert meta.query_start_loc_tensor.tolist() == expected["query_start_loc"]
        assert meta.seq_lens_tensor.tolist() == expected["seq_lens"]
        assert rows.tolist() == expected["rows"]
        if all(slot == NO_LORA for slot in expected["lora"]):
            assert token_slots is None
        else:
            assert token_slots.tolist() == expected["lora"]
        for i, s in enumerate(scheduled):  # entries past a sequence's blocks are never read
            assert meta.block_tables[i, : len(s.block_ids)].tolist() == s.block_ids
        if all(s.num_new_tokens == 1 for s in scheduled):
            check_decode(batch, scheduled, expected)
            checked_decode += 1
        sim.after_step(scheduled)
    assert checked_decode > 10


def check_decode(batch: InputBatch, scheduled, expected) -> None:
    n = len(scheduled)
    size = n + (1 if n < MAX_SEQS else 0)  # one padding row when there is room
    use_lora = batch.prepare_decode(scheduled, size)
    assert use_lora == any(slot != NO_LORA for slot in expected["lora"])
    twins = batch.decode
    pad = size - n
    assert twins.input_ids[:size].tolist() == expected["input_ids"] + [0] * pad
    assert twins.positions[:size].tolist() == expected["positions"] + [0] * pad
    assert twins.slot_mapping[:size].tolist() == expected["slot_mapping"] + [PAD_BLOCK * BLOCK_SIZE] * pad
    assert twins.seq_lens[:size].tolist() == expected["seq_lens"] + [1] * pad
    assert twins.token_slots[:size].tolist() == expected["lora"] + [NO_LORA] * pad
    tables = twins.block_tables.device
    for i, s in enumerate(scheduled):
        assert tables[i, : len(s.block_ids)].tolist() == s.block_ids
    assert tables[n:size, 0].tolist() == [PAD_BLOCK] * pad


def test_steady_decode_writes_only_new_blocks():
    """Rows stay put while the same requests keep decoding; a block is written once."""
    batch = InputBatch(MAX_SEQS, MAX_TOKENS, MAX_BLOCKS, BLOCK_SIZE, PAD_BLOCK, torch.device("cpu"))
    requests = [Request(f"r{i}", [1] * 3, SamplingParams()) for i in range(3)]
    tables = [[10 + i] for i in range(3)]
    for step in range(6):
        scheduled = []
        for r, table in zip(requests, tables):
            if r.num_tokens > len(table) * BLOCK_SIZE:
                table.append(100 + len(table) * 10 + int(r.request_id[1:]))
            scheduled.append(ScheduledRequest(r, 1, r.num_tokens - 1, list(table)))
        batch.update(scheduled)
        assert batch.requests == requests
        assert batch.num_blocks[:3].tolist() == [len(t) for t in tables]
        for r in requests:
            r.append_output_token(7)
        if step == 0:
            batch.block_table[:3, 0] = -5  # a row rewritten after this would lose the mark
    assert batch.block_table[:3, 0].tolist() == [-5, -5, -5]
    assert len(tables[0]) > 1
    assert batch.block_table[0, 1 : len(tables[0])].tolist() == tables[0][1:]


def test_too_many_sequences_is_refused():
    batch = InputBatch(2, MAX_TOKENS, MAX_BLOCKS, BLOCK_SIZE, PAD_BLOCK, torch.device("cpu"))
    scheduled = [ScheduledRequest(Request(f"r{i}", [1], SamplingParams()), 1, 0, [i]) for i in range(3)]
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        batch.update(scheduled)
