"""Grouped LoRA ops: apply many adapters to one batch, one slot index per token.

`add_lora` / `add_lora_multi` (fused shrink + expand) on dense slot stacks, `add_lora_paged` on
adapters kept in pages of rank rows (memory by rank), `shrink` and `expand` run Triton kernels on CUDA
tensors and the plain-torch `reference` on the CPU; `LoRABatchMeta` holds the per-step token bookkeeping
that the segmented kernels share across layers.
"""

from lora_kernels.meta import NO_LORA, LoRABatchMeta
from lora_kernels.ops import add_lora, add_lora_multi, add_lora_paged, expand, shrink

__all__ = ["NO_LORA", "LoRABatchMeta", "add_lora", "add_lora_multi", "add_lora_paged", "expand", "shrink"]
