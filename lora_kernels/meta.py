"""Per-step token bookkeeping for the segmented (SGMV-like) kernels: built once per step, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Token slot of a token that uses no adapter.
NO_LORA = -1

# Tile heights of the segmented kernels: tl.dot needs at least 16 rows; 64 rows of a 128-wide K block is
# 16 KB of bf16 x per load, enough to keep HBM busy without spilling.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64


def choose_block_m(num_tokens: int, num_slots: int) -> int:
    """Tile height for a batch shape: about the mean tokens per slot, as a power of two in [16, 64]."""
    mean = -(-num_tokens // max(num_slots, 1))
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, 1 << max(mean - 1, 0).bit_length()))


def max_num_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound on the tiles of a batch: each non-empty segment wastes at most one partial tile."""
    return -(-num_tokens // block_m) + min(num_slots + 1, num_tokens)


@dataclass
class LoRABatchMeta:
    """Token order and tiles for one step, in preallocated device buffers (no host sync, CUDA-graph safe).

    Tokens are grouped by slot (stable), tokens without an adapter last, and each group is cut into tiles of
    at most `block_m` tokens; a segmented kernel runs one program per tile (x a split or an output block).
    The grid is `max_num_tiles(...)`, known from shapes alone; tiles past the real count have length 0 and
    their programs return at once. A worked example, num_slots = 3 (block_m = 16, so one tile per slot):

        token_slots     = [-1, 0, 2, 1, 0]
        segment key     = [ 3, 0, 2, 1, 0]       NO_LORA -> num_slots, so it sorts last
        sorted_tokens   = [ 1, 4, 3, 2, 0]       token indices in key order (stable)
        tokens_per_slot = [ 2, 1, 1, 1]          slots 0, 1, 2, then NO_LORA
        slot_starts     = [ 0, 2, 3, 4]          exclusive cumsum: where each slot begins in sorted_tokens
        tiles           = (slot 0, start 0, len 2), (slot 1, 2, 1), (slot 2, 3, 1), (NO_LORA, 4, 1),
                          then one (len 0) tile up to max_num_tiles(5, 3, 16) = 1 + 4 = 5

    The gathered (BGMV-like) kernels read `token_slots` directly and need none of this.
    """

    num_slots: int
    max_tokens: int
    sorted_tokens: torch.Tensor  # [max_tokens] int32, token indices grouped by slot, NO_LORA last
    tokens_per_slot: torch.Tensor  # [num_slots + 1] int32, the last entry counts NO_LORA tokens
    slot_starts: torch.Tensor  # [num_slots + 1] int32, first position of each slot in sorted_tokens
    tile_slot: torch.Tensor  # [max_tiles] int32, slot of each tile (NO_LORA: the tile only zeroes h)
    tile_start: torch.Tensor  # [max_tiles] int32, first position of each tile in sorted_tokens
    tile_len: torch.Tensor  # [max_tiles] int32, tokens in each tile, 0 past the last tile
    any_lora: torch.Tensor  # [1] bool, whether any token uses an adapter (read on device, never synced)
    # Host-side shape of the last update (set by update(); kernels size their grids from these):
    num_tokens: int = field(init=False, default=0)
    block_m: int = field(init=False, default=MIN_BLOCK_M)  # tile height chosen for that batch shape
    num_tiles: int = field(init=False, default=0)  # max_num_tiles(num_tokens, num_slots, block_m)

    @classmethod
    def allocate(cls, max_tokens: int, num_slots: int, device: torch.device | str) -> LoRABatchMeta:
        """Buffers for batches of up to `max_tokens` tokens; fill them with `update` before each step."""
        if max_tokens < 1 or num_slots < 1:
            raise ValueError(f"max_tokens ({max_tokens}) and num_slots ({num_slots}) must be positive")
        max_tiles = max_num_tiles(max_tokens, num_slots, MIN_BLOCK_M)

        def buffer(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=device)

        return cls(
            num_slots=num_slots,
            max_tokens=max_tokens,
            sorted_tokens=buffer(max_tokens),
            tokens_per_slot=buffer(num_slots + 1),
            slot_starts=buffer(num_slots + 1),
            tile_slot=buffer(max_tiles),
            tile_start=buffer(max_tiles),
            tile_len=buffer(max_tiles),
            any_lora=torch.zeros(1, dtype=torch.bool, device=device),
        )

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int) -> LoRABatchMeta:
        """Allocate for exactly this batch and fill (eager use; graphs should `allocate` once instead)."""
        meta = cls.allocate(max(token_slots.numel(), 1), num_slots, token_slots.device)
        return meta.update(token_slots)

    def update(self, token_slots: torch.Tensor) -> LoRABatchMeta:  # token_slots: [num_tokens] int32
        """Refill the buffers for a new step with device ops only (no host sync); returns self.

        Slots outside [-1, num_slots) are clamped into the NO_LORA group here; the kernels' own `validate`
        mode is where such values are reported.
        """
        num_tokens = token_slots.numel()
        if token_slots.dim() != 1 or num_tokens > self.max_tokens:
            raise ValueError(
                f"token_slots must be 1-D with at most max_tokens={self.max_tokens} entries, got shape "
                f"{tuple(token_slots.shape)}; allocate a larger LoRABatchMeta"
            )
        if token_slots.device != self.sorted_tokens.device:
            raise ValueError(
                f"token_slots is on {token_slots.device}, the buffers on {self.sorted_tokens.device}"
            )
        num_slots = self.num_slots
        block_m = choose_block_m(num_tokens, num_slots)
        num_tiles = max_num_tiles(num_tokens, num_slots, block_m)
        device = token_slots.device

        key = token_slots.to(torch.long)
        key = torch.where((key < 0) | (key >= num_slots), num_slots, key)  # [num_tokens]
        order = torch.argsort(key, stable=True)  # [num_tokens]
        counts = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
        counts.scatter_add_(0, key, torch.ones_like(key))  # bincount syncs on CUDA, scatter_add does not
        starts = torch.cumsum(counts, 0) - counts  # [num_slots + 1]
        tiles = (counts + block_m - 1) // block_m  # [num_slots + 1]
        tiles_end = torch.cumsum(tiles, 0)  # [num_slots + 1]
        tile_ids = torch.arange(num_tiles, device=device)  # [num_tiles]
        segment = torch.searchsorted(tiles_end, tile_ids, right=True)  # num_slots + 1 past the last tile
        seg = segment.clamp(max=num_slots)
        offset = (
            tile_ids - (tiles_end[seg] - tiles[seg])
        ) * block_m  # first token of the tile in its segment
        length = torch.where(segment <= num_slots, (counts[seg] - offset).clamp(0, block_m), 0)

        self.sorted_tokens[:num_tokens].copy_(order)
        self.tokens_per_slot.copy_(counts)
        self.slot_starts.copy_(starts)
        self.tile_slot[:num_tiles].copy_(torch.where(seg == num_slots, NO_LORA, seg))
        self.tile_start[:num_tiles].copy_(starts[seg] + offset)
        self.tile_len[:num_tiles].copy_(length)
        self.any_lora.copy_((counts[:num_slots].sum() > 0).reshape(1))
        self.num_tokens, self.block_m, self.num_tiles = num_tokens, block_m, num_tiles
        return self
