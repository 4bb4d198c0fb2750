"""Fixtures for the adapter store: a tiny random Llama, real PEFT adapters, moto's S3 server, stores.

Adapters are made by PEFT itself (get_peft_model + save_pretrained), never hand-written, so the
tests check the store against what users really upload. S3 tests talk real HTTP through boto3 to
moto's threaded server on loopback (tests/fixtures_s3.py, shared with tests/platform).
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import uuid
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from fixtures_s3 import *  # noqa: F403 (s3_endpoint, s3_admin, s3_bucket: shared with tests/platform)
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from adapter_format.model_shape import ModelShape
from adapters_store import AdapterFiles, CountingMetrics, StoreConfig, open_store
from adapters_store.s3 import S3Store, make_client

TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    intermediate_size=128,
)
# Retries fast enough for tests; real deployments keep the defaults.
FAST_RETRIES = dict(
    retries=2, backoff_s=0.001, max_backoff_s=0.002, connect_timeout_s=2.0, read_timeout_s=5.0
)
BACKENDS = ["local", "s3"]


@pytest.fixture(scope="session")
def fast_retries() -> dict:
    return dict(FAST_RETRIES)


@pytest.fixture(scope="session")
def model_shape() -> ModelShape:
    return ModelShape.from_hf_config(LlamaConfig(**TINY_LLAMA))


@pytest.fixture(scope="session")
def make_peft_adapter(tmp_path_factory):
    """make_peft_adapter(r=8, target_modules=(...), llama={...}, safe=True, **lora_kwargs) -> folder."""
    made: dict[str, Path] = {}

    def make(
        r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), llama=None, safe=True, seed=0, **lora_kwargs
    ):
        key = json.dumps([r, lora_alpha, target_modules, llama, safe, seed, lora_kwargs], sort_keys=True)
        if key not in made:
            torch.manual_seed(seed)
            base = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **(llama or {})}))
            lora = LoraConfig(
                r=r,
                lora_alpha=lora_alpha,
                target_modules=list(target_modules),
                init_lora_weights=False,
                **lora_kwargs,
            )
            folder = tmp_path_factory.mktemp("peft")
            with warnings.catch_warnings():  # deprecations and notices from inside transformers and peft
                warnings.simplefilter("ignore")
                get_peft_model(base, lora).save_pretrained(folder, safe_serialization=safe)
            made[key] = folder
        return made[key]

    return make


@pytest.fixture(scope="session")
def adapter_dir(make_peft_adapter) -> Path:
    """The everyday good adapter: rank 8 over q_proj and v_proj (save_pretrained also wrote README.md)."""
    return make_peft_adapter()


@pytest.fixture(scope="session")
def other_adapter_dir(make_peft_adapter) -> Path:
    """A second good adapter with other bytes: rank 4 over all seven projections."""
    all_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return make_peft_adapter(r=4, lora_alpha=8, target_modules=all_modules, seed=1)


@pytest.fixture
def copy_adapter(tmp_path):
    """copy_adapter(folder, config_changes={...}) -> an editable copy of an adapter folder."""

    def copy(folder: Path, config_changes: dict | None = None) -> Path:
        dest = tmp_path / f"copy-{uuid.uuid4().hex[:8]}"
        shutil.copytree(folder, dest)
        if config_changes:
            config_path = dest / "adapter_config.json"
            config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **config_changes}))
        return dest

    return copy


@pytest.fixture(scope="session")
def files_of():
    """files_of(folder) -> AdapterFiles of the folder's two files, as an HTTP upload passes them."""

    def files(folder: Path) -> AdapterFiles:
        return AdapterFiles(
            config=folder / "adapter_config.json", weights=folder / "adapter_model.safetensors"
        )

    return files


@pytest.fixture
def archives(tmp_path):
    """Builders of upload archives, honest and hostile."""
    return ArchiveBuilder(tmp_path)


class ArchiveBuilder:
    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path

    def tar_gz(self, folder: Path, top: str | None = "my-adapter") -> Path:
        """`tar czf` of a folder: the files under one top-level folder, or at the root (top=None)."""
        path = self.tmp_path / f"{uuid.uuid4().hex[:8]}.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            for f in sorted(folder.iterdir()):
                tar.add(f, arcname=f"{top}/{f.name}" if top else f.name)
        return path

    def zip(self, folder: Path, top: str | None = "my-adapter") -> Path:
        path = self.tmp_path / f"{uuid.uuid4().hex[:8]}.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for f in sorted(folder.iterdir()):
                zf.write(f, arcname=f"{top}/{f.name}" if top else f.name)
        return path

    def tar_members(self, members: list[tarfile.TarInfo | tuple[str, bytes]]) -> Path:
        """A .tar.gz of exactly these members: (name, data) files or prepared TarInfo entries."""
        path = self.tmp_path / f"{uuid.uuid4().hex[:8]}.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            for member in members:
                if isinstance(member, tarfile.TarInfo):
                    tar.addfile(member)
                else:
                    name, data = member
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        return path

    def zip_members(self, members: list[zipfile.ZipInfo | tuple[str, bytes]], data: bytes = b"") -> Path:
        path = self.tmp_path / f"{uuid.uuid4().hex[:8]}.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for member in members:
                if isinstance(member, zipfile.ZipInfo):
                    zf.writestr(member, data)
                else:
                    zf.writestr(*member)
        return path


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def s3_client(s3_endpoint):
    """One store client for the session: creating a boto3 client costs a few hundred milliseconds.

    Tests that hook the client's events (fault injection) make their own store and client instead.
    """
    return make_client(StoreConfig(url="s3://unused", endpoint_url=s3_endpoint, **FAST_RETRIES))


@pytest.fixture
def make_store(backend, request, tmp_path, model_shape):
    """make_store(**StoreConfig overrides) -> a fresh store of the parametrized backend (CountingMetrics)."""

    def make(**overrides):
        base = dict(url=f"file://{tmp_path / 'store'}", **FAST_RETRIES, staging_dir=str(tmp_path / "staging"))
        if backend == "local":
            return open_store(StoreConfig(**{**base, **overrides}), model_shape, CountingMetrics())
        bucket = request.getfixturevalue("s3_bucket")
        config = StoreConfig(**{**base, "url": f"s3://{bucket}/tenants", **overrides})
        return S3Store(
            bucket,
            "tenants",
            config,
            model_shape,
            CountingMetrics(),
            client=request.getfixturevalue("s3_client"),
        )

    return make


@pytest.fixture
def store(make_store):
    return make_store()


@pytest.fixture(scope="session")
def keys_of():
    """keys_of(store) -> every key the backend holds, relative to the store root (sorted)."""
    return lambda store: sorted(store._list_keys(""))
