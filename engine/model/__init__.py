"""Llama-family model code: layers, paged attention (torch path), RoPE, checkpoint loading."""
