"""Grouped LoRA ops: apply many adapters to one batch, one slot index per token."""

from lora_kernels.reference import add_lora

__all__ = ["add_lora"]
