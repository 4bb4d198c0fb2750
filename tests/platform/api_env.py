"""Fixtures for the adapter, route and resolution API tests: real parts, a tiny model shape, PEFT adapters.

`api_env(...)` builds Services from real parts (a LocalStore or S3 store, an embedded or Redis config
store, an Authenticator with keys for two tenants, a Router, a fake engine that records forgotten
adapters) and the server's app from `create_app(settings, services=...)`.
tests/platform/conftest.py star-imports this module so its fixtures reach every test here.
"""

from __future__ import annotations

import json
import shutil
import socket
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from fixtures_s3 import s3_admin, s3_bucket, s3_endpoint
from litestar import Litestar
from loraserve.app import create_app
from loraserve.config_store import ConfigStore, EmbeddedConfigStore
from loraserve.routing import Router
from loraserve.services import Services
from loraserve.settings import ServerSettings
from loraserve.tenancy import ApiKey, Authenticator, ConcurrencyLimiter, Principal, hash_key
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from adapter_format.model_shape import ModelShape
from adapters_store import AdapterStore, DiskCache, LocalStore, StoreConfig

# The fixtures conftest.py star-imports (moto's S3 server comes from the shared tests/fixtures_s3.py).
__all__ = ["api_env", "edit_adapter", "peft_adapters", "s3_admin", "s3_bucket", "s3_endpoint"]

BASE_MODEL = "tiny-llama"
TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    intermediate_size=128,
)
# Tenant "alpha" has an admin and a user key; tenant "beta" an admin key.
ADMIN_A, USER_A, ADMIN_B = "sk-alpha-admin", "sk-alpha-user", "sk-beta-admin"
KEYS = {ADMIN_A: ("alpha", "admin"), USER_A: ("alpha", "user"), ADMIN_B: ("beta", "admin")}
# Small limits so oversize uploads are cheap to build; the test adapters are about 20 KiB.
SMALL_LIMITS = dict(max_adapter_bytes=256 * 1024, max_archive_bytes=384 * 1024, max_archive_files=8)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class FakeEngine:
    """Records what the adapter API tells the engine; generation is not part of these tests."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def generate(self, prompt, params, request_id, adapter=None):
        raise AssertionError("the adapter API never generates")

    async def abort(self, request_id: str) -> None:
        raise AssertionError("the adapter API never aborts")

    def forget_adapter(self, adapter_id: str) -> None:
        self.forgotten.append(adapter_id)


@dataclass
class ApiEnv:
    services: Services
    engine: FakeEngine
    app: Litestar
    store_config: StoreConfig
    principals: dict[str, Principal] = field(default_factory=dict)  # by key, for direct service calls


def free_port_for_cli() -> int:
    """A loopback port nothing listens on (bound, read, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_shape() -> ModelShape:
    return ModelShape.from_hf_config(LlamaConfig(**TINY_LLAMA))


def build_services(
    tmp_path: Path,
    *,
    store: AdapterStore | None = None,
    config_store: ConfigStore | None = None,
    engine: FakeEngine | None = None,
) -> Services:
    if store is None:
        config = StoreConfig(
            url=f"file://{tmp_path / 'store'}", staging_dir=str(tmp_path / "staging"), **SMALL_LIMITS
        )
        store = LocalStore(tmp_path / "store", config, tiny_shape())
    keys = [ApiKey(key_hash=hash_key(k), tenant=t, role=r) for k, (t, r) in KEYS.items()]
    return Services(
        base_model_id=BASE_MODEL,
        engine=engine,
        adapter_store=store,
        disk_cache=DiskCache(store, tmp_path / f"cache-{uuid.uuid4().hex[:6]}", 1 << 30),
        config_store=config_store or EmbeddedConfigStore(tmp_path / "config"),
        authenticator=Authenticator(keys),
        router=Router(),
        limiter=ConcurrencyLimiter(),
    )


def build_app(services: Services) -> Litestar:
    """The server's own app (create_app) around these services: every controller and the error table."""
    return create_app(ServerSettings(served_model_name=BASE_MODEL), services=services)


@pytest.fixture
def api_env(tmp_path):
    """api_env(**build_services options) -> ApiEnv with a FakeEngine."""

    def make(**options) -> ApiEnv:
        engine = FakeEngine()
        services = build_services(tmp_path, engine=engine, **options)
        principals = {k: Principal(tenant=t, role=r) for k, (t, r) in KEYS.items()}
        return ApiEnv(services, engine, build_app(services), services.adapter_store.config, principals)

    return make


def _save_peft_adapter(folder: Path, r: int, target_modules: tuple[str, ...], seed: int) -> Path:
    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(target_modules), init_lora_weights=False)
    with warnings.catch_warnings():  # deprecation notices from inside transformers and peft
        warnings.simplefilter("ignore")
        get_peft_model(base, lora).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def peft_adapters(tmp_path_factory) -> dict[str, Path]:
    """Two real PEFT adapter folders for the tiny Llama: `qv` (rank 8) and `all` (rank 4, 7 modules)."""
    root = tmp_path_factory.mktemp("peft")
    all_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {
        "qv": _save_peft_adapter(root / "qv", 8, ("q_proj", "v_proj"), seed=0),
        "all": _save_peft_adapter(root / "all", 4, all_modules, seed=1),
    }


@pytest.fixture
def edit_adapter(tmp_path):
    """edit_adapter(folder, config_changes) -> a copy of the folder with adapter_config.json changed."""

    def edit(folder: Path, config_changes: dict) -> Path:
        dest = tmp_path / f"edited-{uuid.uuid4().hex[:8]}"
        shutil.copytree(folder, dest)
        config_path = dest / "adapter_config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **config_changes}))
        return dest

    return edit


def upload_files(folder: Path) -> list[tuple[str, tuple[str, bytes]]]:
    """The multipart `files` parts of a PEFT folder, as `curl -F files=@...` sends them."""
    return [
        ("files", (filename, (folder / filename).read_bytes()))
        for filename in ("adapter_config.json", "adapter_model.safetensors")
    ]


def upload(client, name: str, folder: Path, key: str = ADMIN_A):
    """POST /v1/adapters of a PEFT folder through a sync TestClient."""
    return client.post("/v1/adapters", data={"name": name}, files=upload_files(folder), headers=bearer(key))
