"""LoRA on the routed experts of a mixture-of-experts layer: each (token, expert) pair adds its adapter's
low-rank update of that expert, computed beside the fused-MoE kernels (engine/model/moe_kernels.py),
which add it before the activation (gate/up) and before the routing weight (down).

The pool (engine/lora/pool.py) holds per page PAGE_RANK ranks of every expert's pair, A [E, PAGE_RANK, in]
and B [E, out, PAGE_RANK] per layer, so an adapter takes pages by its own rank, as every target does.
For pair p (token t, expert e, slot s):

    h_p     = scale_s * A_s,e x_t        [R]   (ranks past the adapter's zeroed: its page-table row
    delta_p = B_s,e h_p                  [out]  holds stale ids there)

Two paths, following the MoE layer's (SparseMoE.runs_triton, the one place it is chosen):
- on the Triton path (CUDA; on the CPU with attention_backend="triton" under TRITON_INTERPRET=1), one
  Triton kernel per projection (lora_kernels/expert_kernels.py): a program per pair walks the slot's
  page-table row and reads A and B straight from the pool, h stays in registers (fp32), delta is
  rounded once; nothing per pair is materialized, and the grid is fixed by the number of pairs (CUDA
  graphs);
- on the torch path (the CPU by default), two batched GEMMs over the pairs with A and B gathered by
  (page, expert), in chunks of CHUNK pairs so a long prefill never copies more than CHUNK pairs' weights.
Both: no Python loop over experts or adapters, pairs of base-model tokens and of another rank's experts
give 0.
"""

from __future__ import annotations

import torch

from lora_kernels.expert_kernels import expert_lora_delta, pair_order

CHUNK = 1024


class ExpertLoRA:
    def __init__(
        self,
        context,
        layer: int,
        x: torch.Tensor,  # [T, H]
        local_ids: torch.Tensor,  # [T * top_k] local expert ids, num_local: another rank's
        top_k: int,
        num_local: int,
        kernel: bool,  # the Triton kernel (the MoE layer's choice, SparseMoE.runs_triton), else torch
    ):
        pool = context.slots
        self.slots = pool.layers[layer]
        self.page_table = pool.page_table  # [max_loras, max_pages]
        self.x = x
        self.kernel = kernel
        self.token_slots, self.local_ids = context.token_slots, local_ids  # [T], [P]
        self.top_k, self.num_local = top_k, num_local
        if self.kernel:  # one order for both projections: prefill's pairs grouped by (slot, expert)
            self.order = pair_order(context.token_slots, local_ids, top_k, num_local)
            return
        token_slots = context.token_slots.long()
        pair_slots = token_slots.repeat_interleave(top_k)  # [P]
        self.active = (pair_slots >= 0) & (local_ids < num_local)
        self.slot = pair_slots.clamp(min=0)
        self.expert = local_ids.clamp(max=num_local - 1).long()
        self.token = torch.arange(local_ids.numel(), device=x.device) // top_k

    def gate_up(self) -> torch.Tensor:  # [P, 2 * I_local]
        return self._delta("experts.gate_up_proj", self.x, per_pair=False)

    def down(self, inter: torch.Tensor) -> torch.Tensor:  # [P, I_local] -> [P, H]
        return self._delta("experts.down_proj", inter, per_pair=True)

    def _delta(self, module: str, x: torch.Tensor, per_pair: bool) -> torch.Tensor:
        """x: [T, in] (a row per token, per_pair False) or [P, in] (a row per pair) -> [P, out]."""
        target = self.slots[module]
        lora_a, lora_b = target.lora_a, target.lora_b  # [pages, E, P, in], [pages, E, out, P]
        if self.kernel:
            return expert_lora_delta(
                x, lora_a, lora_b, self.page_table, self.token_slots, self.local_ids, target.scales,
                target.ranks, self.top_k, self.num_local, per_pair_input=per_pair, order=self.order,
            )  # fmt: skip
        out_features = lora_b.shape[2]
        num_pairs = self.slot.numel()
        delta = torch.empty(num_pairs, out_features, dtype=x.dtype, device=x.device)
        for start in range(0, num_pairs, CHUNK):
            end = min(start + CHUNK, num_pairs)
            slot, expert = self.slot[start:end], self.expert[start:end]
            pages = self.page_table[slot].long()  # [c, max_pages]
            a = lora_a[pages, expert[:, None]].flatten(1, 2)  # [c, R, in]
            inputs = x[start:end] if per_pair else x[self.token[start:end]]
            h = torch.bmm(a, inputs[:, :, None]).squeeze(-1)  # [c, R]
            ranks = torch.arange(h.shape[1], device=h.device)
            scale = target.scales[slot] * self.active[start:end]  # [c] float32, 0 for inactive pairs
            keep = (ranks[None, :] < target.ranks[slot][:, None]).to(h.dtype)
            h = h * keep * scale[:, None].to(h.dtype)
            b = lora_b[pages, expert[:, None]].permute(0, 2, 1, 3).flatten(2)  # [c, out, R]
            delta[start:end] = torch.bmm(b, h[:, :, None]).squeeze(-1)
        return delta
