"""`loraserve serve --tensor-parallel-size 2` on the CPU (gloo), driven over HTTP: an adapter uploaded while
serving reaches every rank's shard and serves transformers + PEFT's greedy tokens, prompt logprobs
included; a worker killed mid-stream ends every stream with an error event, /health stops answering 200,
the server exits non-zero and no process of it is left.

On a host with two GPUs the same tests drive the server on them (NCCL, CUDA graphs):

    LORASERVE_E2E_TP_DEVICE=cuda NCCL_NVLS_ENABLE=0 python -m pytest tests/e2e/test_e2e_tensor_parallel.py -q
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from factories import load_peft_reference, make_adapter, reference_greedy  # noqa: E402
from processes import child_pids, kill_quietly, wait_gone  # noqa: E402
from server_process import tiny_server_args  # noqa: E402

DEVICE = os.environ.get("LORASERVE_E2E_TP_DEVICE", "cpu")  # "cuda": on two GPUs
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        DEVICE == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < 2),
        reason="LORASERVE_E2E_TP_DEVICE=cuda needs two GPUs",
    ),
]
PROMPT = [9, 8, 7, 6, 5]
TP_ARGS = ("--tensor-parallel-size", "2", "--max-num-seqs", "8", "--device", DEVICE)
if DEVICE == "cuda":
    TP_ARGS += ("--gpu-memory-utilization", "0.3")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("e2e-tp") / "model")


def spawned_children(pid: int) -> list[int]:
    """`pid`'s children started by multiprocessing's spawn (not its resource tracker)."""
    return [c for c in child_pids(pid) if b"spawn_main" in _cmdline(c)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def upload(url: str, name: str, folder: Path) -> httpx.Response:
    with (
        (folder / "adapter_config.json").open("rb") as config,
        (folder / "adapter_model.safetensors").open("rb") as weights,
    ):
        return httpx.post(
            f"{url}/v1/adapters",
            data={"name": name},
            files=[
                ("files", ("adapter_config.json", config)),
                ("files", ("adapter_model.safetensors", weights)),
            ],
            timeout=60,
        )


def test_an_adapter_uploaded_while_serving_reaches_every_rank(start_server, model_dir, tmp_path):
    adapter_dir = make_adapter(
        model_dir,
        tmp_path / "helper",
        seed=6,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "o_proj", "down_proj"],
    )
    server = start_server(tiny_server_args(model_dir, *TP_ARGS))
    (core,) = spawned_children(server.process.pid)
    assert len(spawned_children(core)) == 1  # the worker of rank 1
    assert upload(server.url, "helper", adapter_dir).status_code == 201
    body = {
        "model": "helper",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
        "prompt_logprobs": 1,
    }
    served = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert served.status_code == 200, served.text
    choice = served.json()["choices"][0]
    reference = reference_greedy(load_peft_reference(model_dir, {"helper": adapter_dir}), PROMPT, "helper", 8)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in reference]
    assert len(choice["prompt_logprobs"]) == len(PROMPT) and choice["prompt_logprobs"][0] is None


def test_a_killed_worker_fails_every_stream_and_the_server(start_server, model_dir):
    server = start_server(tiny_server_args(model_dir, *TP_ARGS))
    (core,) = spawned_children(server.process.pid)
    (worker,) = spawned_children(core)
    processes = [core, worker, *child_pids(server.process.pid)]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
    }
    streams: list[list[str]] = [[], []]
    started = threading.Barrier(3, timeout=120)

    def stream(events: list[str]) -> None:
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 2:
                        started.wait()

    threads = [threading.Thread(target=stream, args=(events,), daemon=True) for events in streams]
    try:
        for thread in threads:
            thread.start()
        started.wait()  # both streams are generating
        os.kill(worker, signal.SIGKILL)
        for thread in threads:
            thread.join(120)
        for events in streams:
            assert events[-1] == "[DONE]" and len(events) < 100, events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_dead"
        try:
            health = httpx.get(f"{server.url}/health", timeout=10).status_code
        except httpx.HTTPError:  # the server already exited
            health = None
        assert health != 200
        assert server.process.wait(timeout=60) == 1, server.log()
        assert "tensor-parallel worker 1 failed" in server.log()
        assert all(wait_gone(pid, 15) for pid in processes), "a process of the server outlived it"
    finally:
        for pid in processes:
            kill_quietly(pid)
