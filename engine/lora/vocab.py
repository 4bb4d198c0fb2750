"""Adapters with their own token embedding or LM head: PEFT's `modules_to_save` of embed_tokens / lm_head,
and LoRA on them (adapter_format/vocab_modules.py reads both as PEFT does).

Each such adapter holds whole [vocab, hidden] matrices: its embedding and its head (either may be the
base's), so they cannot share the pool's pages of rank rows. `max_vocab_loras` (EngineConfig) sets aside
that many of the GPU slots (slots 0 .. max_vocab_loras - 1) and CPU-tier rows (rows 0 .. the same) with
room for two matrices each; only those hold such adapters, any adapter may use them (plain ones when no
other slot is free), and an adapter's matrices are evicted with it.

Per matrix, an image holds one of:
- nothing (mode BASE): the base model's own matrix serves it;
- a whole matrix (mode OWN): modules_to_save, a saved matrix, or LoRA merged over the base layer PEFT
  saved beside it (`base + scale * left @ right`, computed in float32 on the CPU);
- LoRA factors only (mode FACTORS, when PEFT saved no base layer): `left` [vocab, r] then `right`
  [r, hidden] packed at the start of the matrix's room, merged with the model's own base matrix on the
  GPU when the adapter is copied into its slot.
LoRA over the embedding is exact merged: PEFT adds `scale * (A^T[id] @ B^T)` to the looked-up row, which
is the row of `W + scale * A^T @ B^T`; over the head it is the same product reassociated.

Selecting them per row has static shapes, so decode steps keep their CUDA graphs (engine/cuda_graphs.py
captures this path whenever the pool has vocab slots): every token takes the base embedding row and,
where its slot owns an embedding, that slot's row instead (one gather and a `where` over the step's
tokens); the logits rows of own-head slots are recomputed from their heads by one kernel launch
(lora_kernels/own_heads.py) whose programs of heads no row uses exit at once, so a step reads only the
heads its rows use. Nothing reads the device back to the host. Eager steps with adapters run the same
code (so the warm-up's LoRA steps compile the kernel before ready), and so do the speculative
verification graphs (engine/spec_decode/verify_graphs.py: every lane row, ghosts without an adapter).
With max_vocab_loras 0 there is no VocabSlots and none of this runs.

Under tensor parallelism every rank holds its vocabulary rows of each slot's matrices, as of the base's
(engine/model/layers/embedding.py): `rank_parts` cuts an image's room by rows (LoRA factors by the rows
of `left`, `right` whole, merged with the rank's own base rows), rank 0 takes its rows from the CPU tier
and cuts the workers' for the next step's message (engine/parallel/lora_shards.py). The gather reads
the local ids before the embedding's mask and all-reduce, the head kernel writes this rank's logits
columns before the all-gather, so the assembled rows are those of one rank.
"""

from __future__ import annotations

import numpy as np
import torch

from adapter_format.checkpoint import PeftAdapter
from adapter_format.errors import AdapterError
from adapter_format.vocab_modules import VocabModule, ties_head_to_embedding
from lora_kernels.own_heads import own_head_logits

BASE, OWN, FACTORS = 0, 1, 2
MERGE_ROWS = 4096  # rows of a vocabulary matrix merged at once (float32 scratch)
EMBED, HEAD = 0, 1  # the two matrices of a slot, in this order
# An image's vocab table: per matrix (mode, rank, scale as float32 bits).
TABLE_COLUMNS = 3


def write_vocab(matrices: torch.Tensor, table: torch.Tensor, adapter: PeftAdapter, shape) -> None:
    """Lay an adapter's vocabulary modules out in a CPU-tier row's room: `matrices` [2, vocab, hidden],
    `table` [2, TABLE_COLUMNS] int32 (zeroed here: modules the adapter lacks are the base's)."""
    table.zero_()
    vocab = adapter.vocab
    embed, head = vocab.get("embed_tokens"), vocab.get("lm_head")
    tie = adapter.ensure_weight_tying
    if head is None and embed is not None and ties_head_to_embedding(embed, shape, tie):
        head = embed  # the tied head reads the adapter's embedding (PEFT loads it into the tied weight)
    if embed is None and head is not None and shape.tie_word_embeddings and tie:
        embed = head
    for index, module in ((EMBED, embed), (HEAD, head)):
        if module is not None:
            _write_one(matrices[index], table[index], module)


def _write_one(room: torch.Tensor, row: torch.Tensor, module: VocabModule) -> None:
    if module.left is None:
        room.copy_(module.matrix)
        row[0] = OWN
        return
    left, right = module.left, module.right
    if module.matrix is not None:  # LoRA over the base layer PEFT saved: merge here, in float32
        right32 = right.float()
        for start in range(0, room.shape[0], MERGE_ROWS):  # bounded scratch (a loader's memory)
            end = start + MERGE_ROWS
            part = module.matrix[start:end].float() + module.scale * (left[start:end].float() @ right32)
            room[start:end] = part
        row[0] = OWN
        return
    if left.numel() + right.numel() > room.numel():
        raise AdapterError(
            "rank_too_large",
            f"LoRA of rank {module.rank} on a vocabulary module without its base layer saved needs rank at "
            "most about hidden / 2 here; save the adapter with PEFT's default save_embedding_layers",
        )
    flat = room.view(-1)
    flat[: left.numel()].view(left.shape).copy_(left)
    flat[left.numel() : left.numel() + right.numel()].view(right.shape).copy_(right)
    row[0], row[1] = FACTORS, module.rank
    row[2:3].view(torch.float32)[0] = module.scale


def rank_parts(matrices: torch.Tensor, table: torch.Tensor, start: int, end: int) -> list[tuple]:
    """One rank's vocabulary rows [start, end) of an image's room (`matrices` [2, vocab, hidden], `table`
    [2, TABLE_COLUMNS]), per matrix: () for BASE, (rows [n, hidden],) for OWN, (left [n, r], right
    [r, hidden]) for FACTORS; views of the room, n = end - start (tensor parallelism: plan.vocab_range)."""
    vocab, hidden = matrices.shape[1:]
    parts = []
    for index in (EMBED, HEAD):
        mode = int(table[index, 0])
        if mode == OWN:
            parts.append((matrices[index][start:end],))
        elif mode == FACTORS:
            rank = int(table[index, 1])
            flat = matrices[index].reshape(-1)
            left = flat[: vocab * rank].view(vocab, rank)[start:end]
            right = flat[vocab * rank : vocab * rank + rank * hidden].view(rank, hidden)
            parts.append((left, right))
        else:
            parts.append(())
    return parts


def part_shapes(table: torch.Tensor, rows: int, hidden: int) -> list[list[tuple[int, int]]]:
    """The shapes of `rank_parts`'s tensors for `rows` vocabulary rows, per matrix (what a worker receives)."""
    shapes = []
    for index in (EMBED, HEAD):
        mode = int(table[index, 0])
        if mode == OWN:
            shapes.append([(rows, hidden)])
        elif mode == FACTORS:
            rank = int(table[index, 1])
            shapes.append([(rows, rank), (rank, hidden)])
        else:
            shapes.append([])
    return shapes


class VocabSlots:
    """The GPU side: `matrices`, the embeddings and the heads [max_vocab_loras, vocab, hidden] (this
    rank's vocabulary rows: [vocab_start, vocab_start + vocab_per_rank) under tensor parallelism, the
    last shard's padding rows zero, as the base's); per slot of the pool, the index of its own embedding
    and head in them (`owner` [2, max_loras] int32, -1: the base's; static, read by the captured
    graphs), and `owns_host`, a host copy of which matrices each slot owns (bit EMBED, bit HEAD)."""

    def __init__(self, model, num_slots: int, max_loras: int, dtype: torch.dtype, device: torch.device):
        embedding = model.model.embed_tokens
        self.num_slots = num_slots
        self._base = (embedding.weight, model.lm_head)  # the head's weight is read at use (tied or not)
        # this rank's rows of the whole vocabulary (all of it at tensor_parallel_size 1)
        self.vocab_start = embedding.vocab_start
        self.vocab_end = min(embedding.vocab_start + embedding.vocab_per_rank, embedding.vocab_size)
        shape = (num_slots, embedding.vocab_per_rank, embedding.hidden_size)
        self.matrices = (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        self.owner = torch.full((2, max_loras), -1, dtype=torch.int32, device=device)
        self.owns_host = np.zeros(max_loras, np.int32)

    @property
    def num_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.matrices)

    def load_image(self, slot: int, matrices: torch.Tensor | None, table: torch.Tensor | None) -> None:
        """Fill `slot`'s matrices from an image's room (the whole vocabulary; this rank's rows are taken),
        None: a plain adapter, which owns none."""
        parts = None if matrices is None else rank_parts(matrices, table, self.vocab_start, self.vocab_end)
        self.load(slot, parts, table)

    def load(self, slot: int, parts: list[tuple] | None, table: torch.Tensor | None) -> None:
        """Fill `slot`'s matrices from this rank's parts of an adapter's (`rank_parts`; a worker gets its
        own from rank 0), `table` the image's vocab table; None: a plain adapter, which owns none."""
        owns = 0
        if parts is not None:
            for index in (EMBED, HEAD):
                mode = int(table[index, 0])
                if mode == BASE:
                    continue
                if slot >= self.num_slots:
                    raise ValueError(f"slot {slot} has no room for an adapter's own embedding or head")
                target = self.matrices[index][slot]
                if mode == OWN:
                    (rows,) = parts[index]
                    target[: rows.shape[0]].copy_(rows, non_blocking=True)
                    target[rows.shape[0] :].zero_()  # the last shard's padding rows
                else:
                    self._merge(target, *parts[index], table[index], index)
                owns |= 1 << index
        # in place: the captured graphs read this tensor
        self.owner[:, slot] = torch.tensor(
            [slot if owns >> i & 1 else -1 for i in (EMBED, HEAD)], dtype=torch.int32
        )
        self.owns_host[slot] = owns

    def _merge(
        self, target: torch.Tensor, left: torch.Tensor, right: torch.Tensor, row: torch.Tensor, index: int
    ) -> None:
        """target = base + scale * left @ right over this rank's rows (left [n, r], right [r, hidden]);
        rows past n (padding) keep the base's."""
        scale = float(row[2:3].view(torch.float32)[0])
        vocab = target.shape[0]
        left = left.to(target.device, torch.float32)
        right = right.to(target.device, torch.float32)
        base = self._base[0] if index == EMBED else self._head_weight()
        n = left.shape[0]
        for start in range(0, n, MERGE_ROWS):  # bounded float32 scratch
            end = min(start + MERGE_ROWS, n)
            target[start:end] = (base[start:end].float() + scale * (left[start:end] @ right)).to(target.dtype)
        target[n:vocab] = base[n:vocab]

    def _head_weight(self) -> torch.Tensor:
        head = self._base[1]
        return head.weight if head.weight is not None else self._base[0]

    def embed(self, token_slots: torch.Tensor, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [tokens, hidden] (the base embedding's) with each token whose slot owns an embedding
        given that embedding's row instead; token_slots [tokens] int32 (-1: none), input_ids [tokens]."""
        own = self.owner[EMBED][token_slots.clamp(min=0).long()]  # [tokens]: the slot's embedding or -1
        own = torch.where(token_slots >= 0, own, -1)
        picked = self.matrices[EMBED][own.clamp(min=0).long(), input_ids]  # [tokens, hidden]
        return torch.where((own >= 0)[:, None], picked, rows)

    def head_logits(self, logits: torch.Tensor, hidden: torch.Tensor, row_slots: torch.Tensor) -> None:
        """Recompute, in place, the `logits` rows [rows, vocab] whose slot (`row_slots` [rows] int32)
        owns a head from that head and `hidden` [rows, hidden]; other rows keep the base head's."""
        own_head_logits(logits, hidden, self.matrices[HEAD], row_slots, self.owner[HEAD])
