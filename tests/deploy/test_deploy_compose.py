"""deploy/compose.yaml: valid Compose, started in the right order, wired to its own Redis and MinIO."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest
from deploy_files import COMPOSE, compose_dict, interpolate

compose_spec = pytest.importorskip("compose_spec", reason="compose-spec has wheels for linux x86_64 only")


def test_compose_file_is_valid():
    """compose-spec parses and validates as Docker Compose does, after variable substitution."""
    project = compose_spec.PyCompose.from_yaml(interpolate(COMPOSE.read_text()))
    project.validate()
    assert set(project.service_names()) == {"loraserve", "redis", "minio", "minio-init"}


def test_parser_rejects_a_broken_file():
    broken = interpolate(COMPOSE.read_text()).replace("service_completed_successfully", "service_done", 1)
    with pytest.raises(ValueError):
        compose_spec.PyCompose.from_yaml(broken)


def test_start_order_and_healthchecks():
    services = compose_dict()["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on missing {dependency}"
    assert services["loraserve"]["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "minio": {"condition": "service_healthy"},
        "minio-init": {"condition": "service_completed_successfully"},
    }
    for name in ("loraserve", "redis", "minio"):
        assert services[name]["healthcheck"]["test"], f"{name} has no healthcheck"
    assert "/health" in " ".join(services["loraserve"]["healthcheck"]["test"])


def test_loraserve_uses_the_stack_and_a_gpu():
    services = compose_dict()["services"]
    server = services["loraserve"]
    env = server["environment"]
    store = urlparse(env["LORASERVE_ADAPTER_STORE"])
    assert store.scheme == "s3"
    # The bucket the init container creates is the one the server uses, on the MinIO of this stack.
    assert f"local/{store.netloc}" in " ".join(services["minio-init"]["command"])
    assert urlparse(env["AWS_ENDPOINT_URL"]).hostname == "minio"
    assert env["AWS_ACCESS_KEY_ID"] == services["minio"]["environment"]["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == services["minio"]["environment"]["MINIO_ROOT_PASSWORD"]
    redis = urlparse(env["LORASERVE_CONFIG_STORE"])
    assert redis.hostname == "redis" and redis.password in services["redis"]["command"]
    (device,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    grace = int(server["stop_grace_period"].removesuffix("s"))
    assert grace > float(env["LORASERVE_SHUTDOWN_TIMEOUT"])
    mounts = {m.split(":")[1] if isinstance(m, str) else m["target"]: m for m in server["volumes"]}
    assert {"/models", "/var/cache/huggingface", "/var/cache/loraserve/triton"} <= set(mounts)


def test_what_compose_mounts_exists_and_keys_are_required():
    """The models folder is in the repo, the keys file is required (no open mode by accident) and its
    example parses as the server's keys file, and the header says Compose v2 is needed."""
    from loraserve.tenancy import load_api_keys

    server = compose_dict()["services"]["loraserve"]
    binds = {m.split(":")[1]: m.split(":")[0] for m in server["volumes"] if isinstance(m, str)}
    assert (COMPOSE.parent / binds["/models"].removeprefix("${MODELS_DIR:-").rstrip("}")).is_dir()
    (keys,) = [m for m in server["volumes"] if isinstance(m, dict)]
    assert keys["bind"]["create_host_path"] is False and keys["read_only"] is True
    assert server["environment"]["LORASERVE_API_KEYS"] == keys["target"]
    example = COMPOSE.parent / "api-keys.example.yaml"
    assert any(key.role == "admin" for key in load_api_keys(str(example)))
    assert "Compose v2" in COMPOSE.read_text()
    assert "triton-cache" in compose_dict()["volumes"]
