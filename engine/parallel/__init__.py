"""Tensor parallelism: one model split over the GPUs of a host (Megatron-style), LoRA included.

docs/ARCHITECTURE.md, "Tensor parallelism", draws the design; `EngineConfig.tensor_parallel_size` turns it on.
"""
