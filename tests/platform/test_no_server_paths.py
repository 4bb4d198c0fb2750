"""No refusal names a server path: every refused upload (each hostile table, as files and as an archive,
and the form's own mistakes) and every refused `POST /v1/load_lora_adapter` is scanned for the server's
folders (store, staging, cache, config, the system temp dir). A caller's own `lora_path` may be quoted
back; nothing else. And `load_lora_adapter` never follows a link out of the allowed folders."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile

import pytest
from api_env import ADMIN_A, FakeEngine, bearer, build_app, build_services
from hostile_adapters import (
    CONFIG,
    CONFIG_FILES,
    CONFIG_VALUES,
    PEFT_MISMATCHES,
    WEIGHT_FILES,
    WEIGHTS,
    peft_mismatch_files,
)
from litestar.testing import TestClient


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    services = build_services(root, engine=FakeEngine())
    allowed = root / "allowed"
    allowed.mkdir()
    services.allowed_lora_paths = (str(allowed),)
    with TestClient(build_app(services)) as client:
        yield client, root, allowed


def server_paths_in(text: str, root) -> list[str]:
    markers = [str(root), tempfile.gettempdir() + "/", "loraserve-upload-", "/staging", "/cache/"]
    return [marker for marker in markers if marker in text]


def config_with(folder, key: str, raw: str) -> bytes:
    config = json.loads((folder / CONFIG).read_text())
    config.pop(key, None)
    return (json.dumps(config)[:-1] + f', "{key}": {raw}}}').encode()


def tar_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"adapter/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def hostile_pairs(folder) -> list[tuple[str, dict[str, bytes]]]:
    """(case, {filename: bytes}) for every hostile table, plus files missing."""
    config, weights = (folder / CONFIG).read_bytes(), (folder / WEIGHTS).read_bytes()
    cases = [
        (f"{k}={raw[:10]}", {CONFIG: config_with(folder, k, raw), WEIGHTS: weights})
        for k, raw, _ in CONFIG_VALUES
    ]
    cases += [(case, {CONFIG: data, WEIGHTS: weights}) for case, data, _ in CONFIG_FILES]
    cases += [(case, {CONFIG: config, WEIGHTS: data}) for case, data, _, _ in WEIGHT_FILES]
    cases += [
        (case, dict(zip((CONFIG, WEIGHTS), peft_mismatch_files(folder, changes, edit), strict=True)))
        for case, changes, edit, _, _ in PEFT_MISMATCHES
    ]
    cases += [
        ("no_config", {WEIGHTS: weights}),
        ("no_weights", {CONFIG: config}),
        ("pickle", {"x.bin": b"\x80\x02"}),
    ]
    return cases


def test_no_upload_refusal_names_a_server_path(env, peft_adapters):
    client, root, _ = env
    bodies = []
    for case, files in hostile_pairs(peft_adapters["qv"]):
        parts = [("files", (name, data)) for name, data in files.items()]
        bodies.append(
            (
                f"files:{case}",
                client.post("/v1/adapters", data={"name": "x"}, files=parts, headers=bearer(ADMIN_A)),
            )
        )
        archive = [("archive", ("a.tar.gz", tar_of(files)))]
        bodies.append(
            (
                f"archive:{case}",
                client.post("/v1/adapters", data={"name": "x"}, files=archive, headers=bearer(ADMIN_A)),
            )
        )
    form_mistakes = {
        "no_name": dict(files=[("files", (CONFIG, b"{}"))]),
        "text_files": dict(data={"name": "x", "files": "text"}),
        "unknown_field": dict(data={"name": "x", "other": "1"}),
        "not_an_archive": dict(data={"name": "x"}, files=[("archive", ("a.tgz", b"hello"))]),
        "both": dict(
            data={"name": "x"}, files=[("files", (CONFIG, b"{}")), ("archive", ("a.tgz", b"\x1f\x8b"))]
        ),
        "bad_name": dict(data={"name": "../../etc"}, files=[("files", (CONFIG, b"{}"))]),
    }
    for case, kwargs in form_mistakes.items():
        bodies.append((f"form:{case}", client.post("/v1/adapters", headers=bearer(ADMIN_A), **kwargs)))
    leaks = {case: server_paths_in(r.text, root) for case, r in bodies if server_paths_in(r.text, root)}
    assert all(400 <= r.status_code < 500 for _, r in bodies), [
        (c, r.status_code, r.text) for c, r in bodies if r.status_code >= 500
    ]
    assert leaks == {}, leaks
    assert len(bodies) > 200


def folder_with(allowed, name: str, files: dict[str, bytes]):
    folder = allowed / name
    folder.mkdir()
    for filename, data in files.items():
        (folder / filename).write_bytes(data)
    return folder


def test_no_load_lora_adapter_refusal_names_a_server_path(env, peft_adapters):
    client, root, allowed = env
    cases = {
        case: folder_with(allowed, f"case-{i}", files)
        for i, (case, files) in enumerate(hostile_pairs(peft_adapters["qv"]))
    }
    cases["missing"] = allowed / "nope"
    cases["outside"] = root / "store"
    cases["dotdot"] = allowed / ".." / "store"
    bodies = []
    for i, (case, folder) in enumerate(cases.items()):
        path = str(folder)  # a name of its own and load_inplace: one accepted case cannot hide the next
        body = {"lora_name": f"x{i}", "lora_path": path, "load_inplace": True}
        response = client.post("/v1/load_lora_adapter", json=body, headers=bearer(ADMIN_A))
        bodies.append((case, path, response))
    assert all(400 <= r.status_code < 500 for _, _, r in bodies), [
        (c, r.status_code, r.text) for c, _, r in bodies if r.status_code >= 500
    ]
    leaks = {}
    for case, path, response in bodies:
        text = response.text.replace(json.dumps(path)[1:-1], "<lora_path>")  # the caller's own path
        if found := server_paths_in(text, root):
            leaks[case] = (found, response.text)
    assert leaks == {}, leaks


def test_load_lora_adapter_does_not_follow_links_out_of_the_allowed_folders(env, peft_adapters):
    client, root, allowed = env
    good = peft_adapters["qv"]
    outside = root / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copy(good / WEIGHTS, outside / WEIGHTS)
    shutil.copy(good / CONFIG, outside / CONFIG)

    def linked(name: str, links: dict[str, str]):
        folder = allowed / name
        folder.mkdir()
        for filename in (CONFIG, WEIGHTS):
            if filename in links:
                os.symlink(links[filename], folder / filename)
            else:
                shutil.copy(good / filename, folder / filename)
        return folder

    shared = folder_with(allowed, "shared", {WEIGHTS: (good / WEIGHTS).read_bytes()})
    fifo_folder = folder_with(allowed, "fifo", {CONFIG: (good / CONFIG).read_bytes()})
    os.mkfifo(fifo_folder / WEIGHTS)
    cases = {
        "weights_link_out": linked("w-out", {WEIGHTS: str(outside / WEIGHTS)}),
        "config_link_out": linked("c-out", {CONFIG: str(outside / CONFIG)}),
        "relative_link_out": linked("rel-out", {WEIGHTS: f"../../outside/{WEIGHTS}"}),
        "link_to_proc": linked("proc", {CONFIG: "/proc/self/environ"}),
        "fifo": fifo_folder,
        "link_inside": linked("inside", {WEIGHTS: str(shared / WEIGHTS)}),
    }
    answers = {
        case: client.post(
            "/v1/load_lora_adapter",
            json={"lora_name": case.replace("_", "-"), "lora_path": str(folder)},
            headers=bearer(ADMIN_A),
        )
        for case, folder in cases.items()
    }
    status = {case: r.status_code for case, r in answers.items()}
    assert status == {
        "weights_link_out": 400,
        "config_link_out": 400,
        "relative_link_out": 400,
        "link_to_proc": 400,
        "fifo": 400,
        "link_inside": 200,
    }, {c: r.text for c, r in answers.items()}
    for case in ("weights_link_out", "config_link_out", "relative_link_out", "link_to_proc"):
        error = answers[case].json()["error"]
        assert "not under a folder this server allows loading from" in error["message"], error
        assert error["param"] == "lora_path" and str(outside) not in error["message"]
    assert "not a regular file" in answers["fifo"].json()["error"]["message"]
    listed = {a["name"] for a in client.get("/v1/adapters", headers=bearer(ADMIN_A)).json()["data"]}
    assert "link-inside" in listed and not listed & {
        "weights-link-out",
        "config-link-out",
        "relative-link-out",
    }
