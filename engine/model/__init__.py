"""Model code: the registry of architectures (registry.py, architectures/), their shared blocks (layers/),
paged attention (torch path and Triton kernels), fused element-wise kernels, RoPE, FP8, checkpoint loading."""
