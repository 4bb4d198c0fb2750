"""Uploads stream to disk once and are refused at the weights' header: what an upload costs on the staging
disk, measured at the moments that matter (when the store commits a valid one, when a bad one is refused),
over the real HTTP path; and the per-tenant cap on uploads at once (429)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import tempfile

import pytest
import torch
from api_env import ADMIN_A, ADMIN_B, FakeEngine, bearer, build_app, build_services
from litestar.testing import AsyncTestClient, TestClient
from safetensors.torch import save

from adapter_format.model_shape import ModelShape, module_key
from adapters_store import LocalStore, StoreConfig
from adapters_store import errors as store_errors

# Wide enough that a rank-16 adapter over every projection is a few MiB: above the 1 MiB at which a spooled
# upload part goes to disk, so a second copy would show.
SHAPE = ModelShape(
    num_layers=2, hidden_size=1024, intermediate_size=2048, num_heads=16, num_kv_heads=16, head_dim=64
)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = json.dumps(
    {"peft_type": "LORA", "r": 16, "lora_alpha": 16, "target_modules": list(MODULES)}
).encode()


def wide_adapter() -> bytes:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(SHAPE.num_layers):
        for module in MODULES:
            in_features, out_features = SHAPE.module_dims(module)
            prefix = f"base_model.model.{module_key(layer, module)}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(16, in_features, generator=gen) / 10
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, 16, generator=gen) / 10
    return save(tensors)


def disk_use(*folders) -> int:
    """Bytes of the files under `folders`, named or not: a temporary file made with O_TMPFILE (as the
    standard library's TemporaryFile is on Linux) has no name, so it is found by this process's open
    descriptors instead."""
    total = 0
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(root, name))
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.endswith(" (deleted)") and target.startswith(tuple(str(f) for f in folders)):
                total += os.fstat(int(fd)).st_size
    return total


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An app over a store for SHAPE; the system temp dir and the staging dir are folders of their own."""
    system_tmp, staging = tmp_path / "tmp", tmp_path / "staging"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))  # where any spooled part would land
    config = StoreConfig(url=f"file://{tmp_path / 'store'}", staging_dir=str(staging))
    services = build_services(
        tmp_path, store=LocalStore(tmp_path / "store", config, SHAPE), engine=FakeEngine()
    )
    return services, (system_tmp, staging)


def post(client, weights: bytes, key: str = ADMIN_A):
    files = [("files", ("adapter_config.json", CONFIG)), ("files", ("adapter_model.safetensors", weights))]
    return client.post("/v1/adapters", data={"name": "wide"}, files=files, headers=bearer(key))


def test_a_valid_upload_is_on_disk_once(env, monkeypatch):
    services, folders = env
    weights = wide_adapter()
    assert len(weights) > 2 << 20  # past the 1 MiB at which a spooled part would go to disk
    store, seen = services.adapter_store, []
    commit = store._commit

    def measured_commit(*args, **kwargs):
        seen.append(disk_use(*folders))
        return commit(*args, **kwargs)

    monkeypatch.setattr(store, "_commit", measured_commit)
    with TestClient(build_app(services)) as client:
        response = post(client, weights)
    assert response.status_code == 201, response.text
    assert seen and seen[0] <= len(weights) + len(CONFIG) + (64 << 10), (seen, len(weights))
    assert disk_use(*folders) == 0, "the staging folder goes with the request"


@pytest.mark.parametrize(
    ("head", "code"),
    [
        (struct.pack("<Q", 12) + b'{"x": [1, 2]', "bad_weights"),  # not a header
        (struct.pack("<Q", 1 << 40), "bad_weights"),  # a header longer than any adapter's
        (b"\x80\x02" + b"pickle" * 10, "bad_weights"),  # a pickle renamed
        (None, "shape_mismatch"),  # a valid header, whose shapes do not fit the model (the config came first)
    ],
    ids=["not_json", "huge_length", "pickle", "wrong_shapes"],
)
def test_a_bad_header_is_refused_before_the_body_is_written(env, monkeypatch, head, code):
    services, folders = env
    if head is None:
        prefix = f"base_model.model.{module_key(0, 'q_proj')}"
        entries = {
            f"{prefix}.lora_A.weight": {"dtype": "F32", "shape": [16, 100], "data_offsets": [0, 6400]},
            f"{prefix}.lora_B.weight": {"dtype": "F32", "shape": [1024, 16], "data_offsets": [6400, 71936]},
        }
        header = json.dumps(entries).encode()
        head = struct.pack("<Q", len(header)) + header
    weights = head + os.urandom(4 << 20)  # 4 MiB of body behind the header
    at_refusal = []
    init = store_errors.InvalidAdapter.__init__

    def measured_init(self, *args, **kwargs):
        at_refusal.append(disk_use(*folders))
        init(self, *args, **kwargs)

    monkeypatch.setattr(store_errors.InvalidAdapter, "__init__", measured_init)
    with TestClient(build_app(services)) as client:
        response = post(client, weights)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == code
    assert at_refusal and max(at_refusal) < 64 << 10, f"{max(at_refusal)} bytes on disk when it was refused"
    assert disk_use(*folders) == 0


def test_uploads_past_the_tenants_cap_are_429(env):
    services, _ = env
    files = [
        ("files", ("adapter_config.json", CONFIG)),
        ("files", ("adapter_model.safetensors", wide_adapter())),
    ]
    slots = services.upload_slots

    async def scenario():
        async with AsyncTestClient(build_app(services)) as client:

            async def post_as(key):
                return await client.post("/v1/adapters", data={"name": "w"}, files=files, headers=bearer(key))

            async with slots.acquire("alpha"), slots.acquire("alpha"):  # two of alpha's uploads in progress
                refused, other = await post_as(ADMIN_A), await post_as(ADMIN_B)
            return refused, other, await post_as(ADMIN_A)

    refused, other, after = asyncio.run(scenario())
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "uploads in progress" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "5"
    assert other.status_code == 201, other.text  # another tenant's uploads are not held up
    assert after.status_code == 201, after.text
    assert slots.in_flight("alpha") == 0
