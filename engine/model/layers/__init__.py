"""The shared blocks every architecture is built from (engine/model/architectures/).

- `sharding`: how a dimension is cut over the tensor-parallel ranks, and the ranks' collectives;
- `linear`: column- and row-parallel projections that load their own shard of each checkpoint tensor
  (per-parameter weight loaders; fused q/k/v and gate/up), FP8 included, with LoRA on top;
- `embedding`, `norm`, `rope` (engine/model/rope.py), `attention` (the attention block over the paged
  KV cache), `mlp` (gated MLP, the activation a parameter), `decoder` (the layer and the model).
"""
