"""Session-wide test setup.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here, before
any test module imports lora_kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
