"""Session-wide test setup.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here, before
any test module imports lora_kernels.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process: tests start servers and worker processes beside the test process, and
# on a small machine several torch thread pools contend for the same cores (many times slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """On a GPU run (TRITON_INTERPRET=0) the CPU-tensor kernel tests cannot run: skip them, saying why."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="Triton on CPU tensors: needs TRITON_INTERPRET=1")
    for item in items:
        if "interpreted" in item.keywords:
            item.add_marker(skip)
