"""LoRA on the routed experts of a mixture-of-experts layer: each (token, expert) pair adds its adapter's
low-rank update of that expert, computed beside the fused-MoE kernels (engine/model/moe_kernels.py),
which add it before the activation (gate/up) and before the routing weight (down).

The pool (engine/lora/pool.py) holds per page PAGE_RANK ranks of every expert's pair, A [E, PAGE_RANK, in]
and B [E, out, PAGE_RANK] per layer, so an adapter takes pages by its own rank, as every target does.
For pair p (token t, expert e, slot s):

    h_p     = scale_s * A_s,e x_t        [R]   (ranks past the adapter's zeroed: its page-table row
    delta_p = B_s,e h_p                  [out]  holds stale ids there)

as two batched GEMMs over the pairs, gathered by (page, expert): no Python loop over experts or
adapters, fixed shapes (CUDA graphs), pairs of base-model tokens and of another rank's experts weighted
0. Pairs go in chunks, so a long prefill never gathers more than CHUNK pairs' weights at once.
"""

from __future__ import annotations

import torch

CHUNK = 1024


class ExpertLoRA:
    def __init__(
        self, context, layer: int, x: torch.Tensor, local_ids: torch.Tensor, top_k: int, num_local: int
    ):
        pool = context.slots
        self.slots = pool.layers[layer]
        self.page_table = pool.page_table  # [max_loras, max_pages]
        self.x = x
        token_slots = context.token_slots.long()
        pair_slots = token_slots.repeat_interleave(top_k)  # [P]
        self.active = (pair_slots >= 0) & (local_ids < num_local)
        self.slot = pair_slots.clamp(min=0)
        self.expert = local_ids.clamp(max=num_local - 1).long()
        self.token = torch.arange(local_ids.numel(), device=x.device) // top_k

    def gate_up(self) -> torch.Tensor:  # [P, 2 * I_local]
        return self._delta("experts.gate_up_proj", self.x, self.token)

    def down(self, inter: torch.Tensor) -> torch.Tensor:  # [P, I_local] -> [P, H]
        return self._delta("experts.down_proj", inter, None)

    def _delta(self, module: str, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        target = self.slots[module]
        lora_a, lora_b = target.lora_a, target.lora_b  # [pages, E, P, in], [pages, E, out, P]
        out_features = lora_b.shape[2]
        num_pairs = self.slot.numel()
        delta = torch.empty(num_pairs, out_features, dtype=x.dtype, device=x.device)
        for start in range(0, num_pairs, CHUNK):
            end = min(start + CHUNK, num_pairs)
            slot, expert = self.slot[start:end], self.expert[start:end]
            pages = self.page_table[slot].long()  # [c, max_pages]
            a = lora_a[pages, expert[:, None]].flatten(1, 2)  # [c, R, in]
            inputs = x[start:end] if rows is None else x[rows[start:end]]
            h = torch.bmm(a, inputs[:, :, None]).squeeze(-1)  # [c, R]
            ranks = torch.arange(h.shape[1], device=h.device)
            scale = target.scales[slot] * self.active[start:end]  # [c] float32, 0 for inactive pairs
            keep = (ranks[None, :] < target.ranks[slot][:, None]).to(h.dtype)
            h = h * keep * scale[:, None].to(h.dtype)
            b = lora_b[pages, expert[:, None]].permute(0, 2, 1, 3).flatten(2)  # [c, out, R]
            delta[start:end] = torch.bmm(b, h[:, :, None]).squeeze(-1)
        return delta
