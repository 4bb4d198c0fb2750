"""The image's entry command, run outside Docker with the image's and the Kubernetes environment.

ENV and ENTRYPOINT come from deploy/Dockerfile, the settings from the base ConfigMap and Secrets in
deploy/k8s; only what cannot exist here is swapped: container paths move under tmp_path, the model is a
tiny random Llama, S3 is moto's server and Redis a local redis-server (with the Secret's password).
The server must come up ready, show that the settings took effect, answer the probes the Deployment
uses, export the metrics the HPA and the endpoint picker read, and exit cleanly on SIGTERM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import boto3
import httpx
import pytest
import redis
import yaml
from deploy_files import REPO, container, dockerfile_runtime_env, dockerfile_stages, instructions, one, render
from factories import make_adapter, make_model

pytestmark = pytest.mark.slow
STARTUP_TIMEOUT_S = 180
# Names in the EPP's scoring defaults (deploy/k8s/inference-gateway/epp.yaml) besides the HPA's metric.
PICKER_METRICS = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info")


def _tokenizer():
    """The byte-level BPE tokenizer the engine tests build offline (tests/engine/tokenizer_fixtures.py)."""
    path = REPO / "tests" / "engine" / "tokenizer_fixtures.py"
    spec = importlib.util.spec_from_file_location("deploy_tokenizer_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.byte_level_bpe_tokenizer()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "redis-server exited at start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


@pytest.fixture
def redis_url(tmp_path):
    """A redis-server with the password of the Secret's placeholder URL; yields that URL, host and port swapped."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed; CI must install it (make redis)")
        pytest.skip("redis-server is not installed (make redis)")
    secret_url = urlparse(
        one(render("base"), "Secret", "loraserve-redis")["stringData"]["LORASERVE_CONFIG_STORE"]
    )
    port = _free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(tmp_path),
            "--requirepass",
            secret_url.password,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, process, 10)
        yield secret_url._replace(netloc=f":{secret_url.password}@127.0.0.1:{port}").geturl()
    finally:
        process.kill()
        process.wait(timeout=10)


def container_path(value: str, root: Path) -> str:
    """A path inside the image (/var/..., /etc/...) mapped under `root`; other values unchanged."""
    if value.startswith("/") and not value.startswith("/opt/venv"):
        path = root / value.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        return str(path)
    return value


def image_environment(tmp_path: Path, k8s: list[dict]) -> dict[str, str]:
    """The container's environment: Dockerfile ENV, then the ConfigMap and Secrets the Deployment loads."""
    env: dict[str, str] = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in dockerfile_runtime_env().items():
        if key != "PATH":
            env[key] = container_path(value, tmp_path)
    server = container(one(k8s, "Deployment", "loraserve"), "loraserve")
    for source in server["envFrom"]:
        if "configMapRef" in source:
            data = one(k8s, "ConfigMap", source["configMapRef"]["name"])["data"]
        else:
            data = one(k8s, "Secret", source["secretRef"]["name"])["stringData"]
        env.update({key: container_path(value, tmp_path) for key, value in data.items()})
    # The api-keys Secret, mounted where the Deployment mounts it.
    keys = one(k8s, "Secret", "loraserve-api-keys")["stringData"]["api-keys.yaml"]
    Path(env["LORASERVE_API_KEYS"]).parent.mkdir(parents=True, exist_ok=True)
    Path(env["LORASERVE_API_KEYS"]).write_text(keys)
    return env


def test_entrypoint_serves_with_the_deployment_settings(tmp_path, s3_endpoint, redis_url):
    cli = pytest.importorskip("loraserve.cli", reason="needs `loraserve serve` (platform/loraserve/cli.py)")
    k8s = render("base")
    env = image_environment(tmp_path, k8s)
    # What cannot exist on a test machine: a real model, S3 and Redis, and the container's fixed port.
    tokenizer = _tokenizer()
    model_dir = make_model(
        tmp_path / "models" / "tiny-llama", vocab_size=len(tokenizer), eos_token_id=0, bos_token_id=1
    )
    tokenizer.save_pretrained(model_dir)
    bucket = urlparse(env["LORASERVE_ADAPTER_STORE"]).netloc
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    port, metrics_port = _free_port(), _free_port()
    env.update(
        LORASERVE_MODEL=str(model_dir),
        LORASERVE_PORT=str(port),
        LORASERVE_METRICS_PORT=str(metrics_port),
        AWS_ENDPOINT_URL=s3_endpoint,
        LORASERVE_CONFIG_STORE=redis_url,
        LORASERVE_CPU_KV_CACHE_BYTES=str(8 << 20),
    )
    assert int(env["LORASERVE_MAX_LORAS"]) != cli.ServerSettings.max_loras, (
        "pick a non-default to see it apply"
    )

    (entrypoint,) = instructions(dockerfile_stages()[-1], "ENTRYPOINT")
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        json.loads(entrypoint), env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    admin_key = next(iter(yaml.safe_load(Path(env["LORASERVE_API_KEYS"]).read_text())))
    try:
        _wait_ready(base, process, tmp_path / "server.log")
        _check_settings_took_effect(base, admin_key, env, model_dir, k8s, s3_endpoint, tmp_path)
        _check_metrics(base, f"http://127.0.0.1:{metrics_port}", env, k8s)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        drain = float(env["LORASERVE_SHUTDOWN_TIMEOUT"])
        code = process.wait(timeout=drain + 30)
        log.close()
    assert code == 0, f"exit code {code} after SIGTERM:\n{(tmp_path / 'server.log').read_text()[-3000:]}"


def _wait_ready(base: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"not ready within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _check_settings_took_effect(base, admin_key, env, model_dir, k8s, s3_url, tmp_path) -> None:
    auth = {"Authorization": f"Bearer {admin_key}"}
    # Every probe path of the Deployment answers 200.
    server = container(one(k8s, "Deployment", "loraserve"), "loraserve")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert httpx.get(base + server[probe]["httpGet"]["path"], timeout=5).status_code == 200, probe
    # The keys file took effect: no key is refused, the Secret's key is admin.
    assert httpx.get(f"{base}/v1/models", timeout=5).status_code == 401
    models = httpx.get(f"{base}/v1/models", headers=auth, timeout=5).json()["data"]
    assert any(m["id"] in (str(model_dir), model_dir.name) for m in models), models
    # The S3 settings took effect: an upload lands in the ConfigMap's bucket and prefix on "S3".
    adapter = make_adapter(
        model_dir, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    files = [("files", (p.name, p.read_bytes())) for p in sorted(adapter.iterdir()) if p.is_file()]
    upload = httpx.post(f"{base}/v1/adapters", headers=auth, data={"name": "wired"}, files=files, timeout=60)
    assert upload.status_code == 201, upload.text
    store = urlparse(env["LORASERVE_ADAPTER_STORE"])
    listed = boto3.client("s3", endpoint_url=s3_url).list_objects_v2(Bucket=store.netloc)
    keys = [obj["Key"] for obj in listed.get("Contents", [])]
    assert any(key.startswith(store.path.strip("/") + "/") and "wired" in key for key in keys), keys
    # The Redis URL took effect: a route written through the API is in that Redis.
    route = {"variants": [{"adapter": "wired", "weight": 100}], "sticky": "none"}
    assert httpx.put(f"{base}/v1/routes/wired-route", headers=auth, json=route, timeout=10).status_code in (
        200,
        201,
    )
    client = redis.Redis.from_url(env["LORASERVE_CONFIG_STORE"])
    route_hashes = [key for key in client.scan_iter(match="*:routes:*") if client.type(key) == b"hash"]
    assert any(client.hexists(key, "wired-route") for key in route_hashes), "route not stored in Redis"


def _check_metrics(base: str, metrics_base: str, env: dict, k8s: list) -> None:
    """The HPA's metric, the picker's, and max_lora from LORASERVE_MAX_LORAS, on the metrics port only."""
    assert httpx.get(f"{base}/metrics", timeout=5).status_code == 404  # not on the tenants' port
    metrics = httpx.get(f"{metrics_base}/metrics", timeout=5).text
    hpa_metric = one(k8s, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    for name in (hpa_metric, *PICKER_METRICS):
        assert re.search(rf"^{re.escape(name)}[{{ ]", metrics, re.MULTILINE), f"{name} missing from /metrics"
    assert f'max_lora="{env["LORASERVE_MAX_LORAS"]}"' in metrics
