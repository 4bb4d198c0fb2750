"""Per-request block tables over one BlockPool, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.kv_cache.block_hash import extend_block_hashes
from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.request import Request

if TYPE_CHECKING:
    from engine.kv_events import KVEventRecorder


class KVCacheManager:
    """Per-request block tables over one BlockPool, with prefix caching.

    Blocks are registered in the prefix cache when they are allocated for a step that fills them
    with known tokens, before the runner has written their K/V (as vLLM v1 does). A request admitted
    later in the same step may therefore hit them; this is safe because the owner always comes
    earlier in the batch and the runner writes a layer's K/V for the whole batch before (or, per
    request, in batch order with) that layer's attention reads.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer (got {block_size!r})")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._block_tables: dict[str, list[KVBlock]] = {}  # request_id -> blocks, token order
        # request_id -> the same tables as block ids, kept beside them: the scheduler asks every request's
        # table every step, and copying a list of ints is far cheaper than reading each block's id.
        self._block_ids: dict[str, list[int]] = {}
        # request_id -> hashes of the request's full blocks so far (prefix caching only).
        self._block_hashes: dict[str, list[bytes]] = {}
        # request_id -> how many leading blocks of its table are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, counted once per admission (allocation with nothing computed yet).
        self.num_queries_tokens = 0
        self.num_hit_tokens = 0
        self.events: KVEventRecorder | None = None  # see record_events

    def record_events(self, recorder: KVEventRecorder) -> None:
        """Report every block registered in or dropped from the prefix cache, and every reset, to
        `recorder` (vLLM's KV events, engine/kv_events/)."""
        self.events = self.block_pool.events = recorder

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table: block ids in token order (a fresh list; empty for an unknown request)."""
        return list(self._block_ids.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of leading full blocks already cached, and the tokens they hold.

        Capped below the whole sequence: the step must compute at least the last token to get
        logits to sample from. Does not take references; `allocate_slots` does. A request still missing
        prompt logprobs reads nothing: it needs the logits of every prompt position (as vLLM does).
        """
        if not self.enable_caching or request.needs_prompt_logprobs:
            return [], 0
        hashes = self._hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Give the request blocks for its computed tokens, the prefix hits and `num_new_tokens` more.

        The table after the call holds num_blocks_needed(computed + hits + num_new_tokens) blocks;
        hits come only on admission (nothing computed yet). c computed, h prefix hit, n computed this
        step, _ empty slot; block_size 4::

            continuing (6 computed, 5 new):  | b0: c c c c | b1: c c n n | b2: n n n _ |
                                               existing      existing      returned
            admitting (1 hit block, 7 new):  | b0: h h h h | b1: n n n n | b2: n n n _ |
                                               touched hit   returned      returned

        Every block whose slots all hold known tokens once this step is done (prompt or already
        sampled output) is registered in the prefix cache now. Returns the newly allocated blocks,
        or None, changing nothing, when the pool is short; a hit on a free block counts against the
        free blocks, since taking it removes it from the free queue.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive (got {num_new_tokens})")
        table = self._block_tables.get(request.request_id, [])
        if table and not new_computed_blocks:
            total_tokens = request.num_computed_tokens + num_new_tokens
            if -(-total_tokens // self.block_size) <= len(table):  # most decode steps: no new block
                if self.enable_caching:
                    self._cache_full_blocks(request, table, min(total_tokens, request.num_tokens), 0)
                return []
        if new_computed_blocks and (table or request.num_computed_tokens):
            raise ValueError(
                f"request {request.request_id}: prefix hits can only be added before anything is computed"
            )
        num_new_blocks, num_evictable_hits = self._blocks_to_take(
            request, num_new_tokens, new_computed_blocks
        )
        if num_new_blocks + num_evictable_hits > self.block_pool.num_free_blocks:
            return None
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens

        if self.enable_caching and request.num_computed_tokens == 0 and not table:
            self.num_queries_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_tokens
        # Touch hits before taking new blocks, so a free hit cannot be evicted by this very call.
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        added = [*new_computed_blocks, *new_blocks]
        table = table + added
        self._block_tables[request.request_id] = table
        self._block_ids.setdefault(request.request_id, []).extend(block.block_id for block in added)
        if self.enable_caching:
            self._cache_full_blocks(
                request, table, min(total_tokens, request.num_tokens), len(new_computed_blocks)
            )
        return new_blocks

    def num_missing_blocks(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> int:
        """Free blocks that `allocate_slots` with these arguments lacks (0: it would succeed)."""
        num_new_blocks, num_evictable_hits = self._blocks_to_take(
            request, num_new_tokens, new_computed_blocks
        )
        return max(0, num_new_blocks + num_evictable_hits - self.block_pool.num_free_blocks)

    def num_freeable_blocks(self, request: Request) -> int:
        """Blocks that freeing `request` would return to the free queue: those no other request holds."""
        return sum(1 for block in self._block_tables.get(request.request_id, ()) if block.ref_cnt == 1)

    def shares_unwritten_blocks(self, request: Request) -> bool:
        """Whether another request holds a block registered for tokens of `request` not computed yet.

        Blocks are registered when allocated, so a request admitted later in the same step may hit a
        block whose K/V this request's part of the step is still to write. Freeing `request` before the
        step runs would leave the other one reading K/V that nobody writes; the scheduler avoids it.
        """
        return any(block.ref_cnt > 1 for block in self._unwritten_cached_blocks(request))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first.

        Blocks registered for tokens not computed yet (a request preempted in the step that allocated
        them, before the step ran) lose their hash: their K/V is never written, so nobody may hit them.
        """
        unwritten = self._unwritten_cached_blocks(request)
        table = self._block_tables.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(table))
        for block in unwritten:
            if block.ref_cnt == 0:
                self.block_pool.uncache(block)
        self._block_hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _blocks_to_take(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock]
    ) -> tuple[int, int]:
        """(new blocks, prefix hits now free) that allocating these slots takes from the free queue."""
        table = self._block_tables.get(request.request_id, ())
        total_tokens = (
            request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        )
        num_new_blocks = max(0, self.num_blocks_needed(total_tokens) - len(table) - len(new_computed_blocks))
        return num_new_blocks, sum(1 for block in new_computed_blocks if block.ref_cnt == 0)

    def _unwritten_cached_blocks(self, request: Request) -> list[KVBlock]:
        """Blocks of the table past the computed tokens that carry a hash: this request registered them
        in the step now being scheduled (hits lie below the computed tokens; new blocks come unhashed)."""
        table = self._block_tables.get(request.request_id, ())
        first = request.num_computed_tokens // self.block_size
        return [block for block in table[first:] if block.block_hash is not None]

    def _hashes(self, request: Request) -> list[bytes]:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        return extend_block_hashes(
            hashes, request.all_token_ids, self.block_size, request.adapter_id, request.meta.cache_salt
        )

    def _cache_full_blocks(
        self, request: Request, table: list[KVBlock], num_known_tokens: int, num_hit_blocks: int
    ) -> None:
        """Register blocks [already registered, num_known_tokens // block_size) of the table."""
        num_full_blocks = num_known_tokens // self.block_size
        # Hit blocks are registered already (that is how they were found).
        first = max(self._num_cached_blocks.get(request.request_id, 0), num_hit_blocks)
        if first >= num_full_blocks:
            return
        hashes = self._hashes(request)
        stored = [
            i for i in range(first, num_full_blocks) if self.block_pool.cache_block(table[i], hashes[i])
        ]
        if self.events is not None and stored:
            self._record_stored(request, hashes, stored)
        self._num_cached_blocks[request.request_id] = num_full_blocks

    def _record_stored(self, request: Request, hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly registered blocks (a block whose hash another
        block holds is not registered, so it splits the run: a router already has that hash)."""
        size = self.block_size
        runs: list[list[int]] = []
        for index in stored:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            start, end = run[0], run[-1] + 1
            self.events.stored(
                hashes[start:end],
                hashes[start - 1] if start > 0 else None,
                request.all_token_ids[start * size : end * size],
                request.adapter_id,
            )
