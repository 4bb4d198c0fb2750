"""The names of an adapter's files: what PEFT's `save_pretrained` writes, and all the engine reads."""

from __future__ import annotations

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"  # safetensors only: pickled `.bin` checkpoints are never read
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
