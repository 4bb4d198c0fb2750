"""Bad input at the HTTP boundary (issue 30 items 9, 11, 12, 13) and the cross-tenant name probes: every
answer must be a 4xx with OpenAI's body (or a 2xx where the input is valid), never a 5xx, and never name
a server path or another tenant's things."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import socket
import tarfile
import tempfile
import time
from pathlib import Path

import hostile_adapters as hostile
from client import Api
from stack import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_ROUTES, Stack, admin, user
from tally import Tally

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENDPOINTS = {  # path -> a valid body
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": CHAT,
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6, 7]},
    "/invocations": COMPLETION,
    "/v1/load_lora_adapter": {"lora_name": "probe-load", "lora_path": "/nowhere"},
    "/v1/unload_lora_adapter": {"lora_name": "probe-load"},
}
NOT_UTF8 = [
    b'{"model": "tiny", "prompt": "\xff\xfe"}',
    b'{"model": "tiny", "prompt": "a\xed\xa0\x80b"}',  # a surrogate written as UTF-8
    b'{"model": "tiny", "prompt": "\xc0\xaf"}',  # an overlong encoding
    b'{"model": "tiny", "prompt": "\xe2\x82"}',  # cut inside a character
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\x80"}], "lora_path": "\xfe"}',
]
NOT_JSON = [
    b"",
    b"{",
    b"[1, 2]",
    b'"a string"',
    b"[" * 100_000,
    b'{"a": ' * 50_000 + b"1",
    b"null",
    b"\x00" * 64,
]
WIDE = [2**64, 2**64 + 1, -(2**64) - 1, 10**30, 2**63]
INT_FIELDS = ["max_tokens", "min_tokens", "top_k", "n", "seed", "logprobs", "truncate_prompt_tokens"]
FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
BAD_TYPES = ["one", [1], {"a": 1}, "\x00"]  # "1" is taken as 1, as vLLM (pydantic) takes it
LOGIT_KEYS = [
    "\u0661",
    "\uff15",
    "\u0967\u0968",
    "+1",
    "-1",
    " 1",
    "1 ",
    "1e3",
    "0x10",
    "99999999999999999999999",
]


async def bad_input(api: Api, tally: Tally) -> None:
    tally.begin("9 bad input (UTF-8, wide ints, types, NUL)")
    key = admin("alice")
    for path, body in ENDPOINTS.items():
        for raw in NOT_UTF8 + NOT_JSON:
            response = await api.call(
                "POST", path, key, content=raw, headers={"content-type": "application/json"}
            )
            tally.answer(response, refuse=True, what=f"{path} raw {raw[:24]!r}")
        tally.answer(
            await api.call(
                "POST", path, key, content=json.dumps(body), headers={"content-type": "text/plain"}
            ),
            refuse=None,
            what=f"{path} as text/plain",
        )
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations"):
        base = CHAT if "chat" in path else COMPLETION
        fields = INT_FIELDS + (["max_completion_tokens", "top_logprobs"] if "chat" in path else [])
        for name in fields:
            for value in WIDE + BAD_TYPES:
                body = {**base, name: value, **({"logprobs": True} if name == "top_logprobs" else {})}
                response = await api.call("POST", path, key, json=body)
                tally.answer(response, refuse=True, what=f"{path} {name}={str(value)[:24]}")
        for name in FLOAT_FIELDS:
            for raw in ("NaN", "Infinity", "1e999", '"x"'):
                text = json.dumps(base)[:-1] + f', "{name}": {raw}}}'
                response = await api.call(
                    "POST", path, key, content=text, headers={"content-type": "application/json"}
                )
                tally.answer(response, refuse=True, what=f"{path} {name}={raw}")
    for tokens in ([2**64], [-1], [10**30], ["a"], [1.5], [[1]], "abc"):
        tally.answer(
            await api.call("POST", "/detokenize", key, json={"tokens": tokens}),
            refuse=True,
            what=f"detokenize {tokens}",
        )
    for prompt in (5, [2**64], [[2**64]], None, {"a": 1}):
        tally.answer(
            await api.call("POST", "/tokenize", key, json={"prompt": prompt}),
            refuse=True,
            what=f"tokenize {prompt}",
        )
    for path_value in ("\x00", "a\x00b", "/" * 5000, "x" * 100_000, "\ud800"):
        body = {"lora_name": "probe-nul", "lora_path": path_value}
        text = json.dumps(body)  # a lone surrogate goes out as its \u escape
        response = await api.call(
            "POST", "/v1/load_lora_adapter", key, content=text, headers={"content-type": "application/json"}
        )
        tally.answer(response, refuse=True, what=f"load_lora_adapter lora_path {path_value[:8]!r}")
    for spec in (
        {"guided_grammar": 'root ::= [^\\x00-\\U0010FFFF] "x"'},  # an empty language
        {"guided_regex": "zzzz", "allowed_token_ids": [3, 4]},  # no allowed token spells it
        {"guided_json": {"$ref": "#"}},
    ):
        for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            response = await api.call("POST", path, key, json={**base, **spec, "max_tokens": 4})
            tally.answer(response, refuse=True, what=f"{path} {list(spec)[0]}")
            if response.status_code == 400 and response.json()["error"]["code"] == "generation_failed":
                tally.failed("other", f"{path} {spec}: 400 but code generation_failed")


async def minor(api: Api, tally: Tally, stack: Stack) -> None:
    tally.begin("13 minor (logit_bias, headers, slow clients, symlinks, $ref, min_tokens, route quota)")
    key = user("alice")
    for bias_key in LOGIT_KEYS:
        body = {**COMPLETION, "logit_bias": {bias_key: 1}}
        tally.answer(
            await api.call("POST", "/v1/completions", key, json=body),
            refuse=True,
            what=f"logit_bias {bias_key!r}",
        )
    tally.answer(
        await api.call("POST", "/v1/completions", key, json={**COMPLETION, "logit_bias": {"5": 1}}),
        refuse=False,
        what="logit_bias '5'",
    )
    for first, second in (
        (user("alice"), user("bob")),
        (user("alice"), user("alice")),
        ("bad", user("alice")),
    ):
        raw = [("authorization", f"Bearer {first}"), ("authorization", f"Bearer {second}")]
        response = await api.client.post("/v1/completions", json=COMPLETION, headers=httpx_headers(raw))
        tally.answer(response, refuse=True, what="two Authorization headers")
    for schema in (
        {"$ref": "https://example.com/x.json"},
        {"$ref": "#/$defs/Gone"},
        {"properties": {"a": {"$ref": "#/$defs/B"}}, "$defs": {}},
        {"$dynamicRef": "#x"},
    ):
        body = {**COMPLETION, "guided_json": schema}
        tally.answer(
            await api.call("POST", "/v1/completions", key, json=body), refuse=True, what=f"$ref {schema}"
        )
    for extra in ({"guided_choice": ["a"], "min_tokens": 5}, {"guided_regex": "ab", "min_tokens": 9}):
        body = {**COMPLETION, **extra, "max_tokens": 12}
        tally.answer(
            await api.call("POST", "/v1/completions", key, json=body),
            refuse=True,
            what=f"min_tokens under {extra}",
        )
    await _slow_clients(api, tally)
    await _symlinks(api, tally, stack)
    await _route_quota(api, tally)


def httpx_headers(pairs: list[tuple[str, str]]):
    import httpx

    return httpx.Headers(pairs)


async def _slow_clients(api: Api, tally: Tally) -> None:
    """A client that sends its headers, or its body, a byte at a time must get 408 and lose the connection
    within the configured timeouts, and hold nothing meanwhile."""
    host, port = api.base_url.removeprefix("http://").split(":")

    def trickle(header_only: bool) -> tuple[bytes, float]:
        start = time.monotonic()
        body = json.dumps(COMPLETION).encode()
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            if header_only:  # the request line, then one header byte every half second
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-slow: ")
            else:  # the headers whole, then one body byte every half second
                head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                sock.sendall(head + f"Content-Length: {len(body) + 10_000}\r\n\r\n".encode() + body[:5])
            deadline = start + HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 10
            received = b""
            sock.settimeout(0.5)
            while time.monotonic() < deadline:
                try:
                    sock.sendall(b"y" if header_only else b" ")
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                received += chunk
            return received, time.monotonic() - start

    for header_only in (True, False, True, False):
        received, seconds = await asyncio.to_thread(trickle, header_only)
        tally.tried()
        bound = (HEADER_TIMEOUT_S if header_only else BODY_TIMEOUT_S) + 6
        if seconds > bound:
            tally.failed(
                "stalls",
                f"a trickling {'header' if header_only else 'body'} held its connection {seconds:.0f} s",
            )
        elif received and b" 408 " not in received.split(b"\r\n", 1)[0]:
            tally.failed("other", f"a trickling client got {received[:60]!r}, not 408")


async def _symlinks(api: Api, tally: Tally, stack: Stack) -> None:
    outside = Path(tempfile.mkdtemp(prefix="probe-outside-"))
    try:
        shutil.copytree(stack.adapter_dirs[1], outside / "adapter")
        cases = {}
        linked = stack.allowed_dir / "file-links-out"
        linked.mkdir(exist_ok=True)
        for name in (hostile.CONFIG, hostile.WEIGHTS):
            target = linked / name
            if not target.exists():
                os.symlink(outside / "adapter" / name, target)
        cases["files linking out"] = str(linked)
        folder_link = stack.allowed_dir / "folder-link-out"
        if not folder_link.exists():
            os.symlink(outside / "adapter", folder_link)
        cases["folder linking out"] = str(folder_link)
        cases["dot-dot out"] = str(stack.allowed_dir / ".." / "adapter-1")
        cases["/proc"] = "/proc/self"
        fifo_dir = stack.allowed_dir / "fifo"
        fifo_dir.mkdir(exist_ok=True)
        if not (fifo_dir / hostile.WEIGHTS).exists():
            os.mkfifo(fifo_dir / hostile.WEIGHTS)
            shutil.copy(stack.adapter_dirs[1] / hostile.CONFIG, fifo_dir / hostile.CONFIG)
        cases["a FIFO"] = str(fifo_dir)
        for what, path in cases.items():
            body = {"lora_name": "probe-link", "lora_path": path}
            response = await api.call("POST", "/v1/load_lora_adapter", admin("alice"), json=body)
            tally.answer(
                response, refuse=True, what=f"load_lora_adapter {what}", hidden=(str(outside),), echo=path
            )
    finally:
        shutil.rmtree(outside, ignore_errors=True)


async def _route_quota(api: Api, tally: Tally) -> None:
    key = admin("bob")
    response = await api.call("POST", "/v1/adapters", key, **upload_form("quota-target", None))
    tally.answer(response, refuse=False, what="upload for the route quota")
    for i in range(MAX_ROUTES + 5):
        body = {"variants": [{"adapter": "quota-target", "weight": 1}]}
        response = await api.call("PUT", f"/v1/routes/quota-{i}", key, json=body)
        tally.answer(response, refuse=i >= MAX_ROUTES, what=f"route {i + 1} of quota {MAX_ROUTES}")
    for i in range(MAX_ROUTES + 5):
        await api.call("DELETE", f"/v1/routes/quota-{i}", key)


UPLOAD_FILES: dict[str, tuple[bytes, bytes]] = {}  # name -> (config, weights), filled by the probe


def upload_form(name: str, files: tuple[bytes, bytes] | None) -> dict:
    config, weights = files or UPLOAD_FILES["good"]
    return {
        "data": {"name": name},
        "files": [
            ("files", (hostile.CONFIG, config, "application/json")),
            ("files", (hostile.WEIGHTS, weights, "application/octet-stream")),
        ],
    }


async def hostile_adapters(api: Api, tally: Tally, stack: Stack) -> None:
    """Every malformed or PEFT-incompatible adapter of tests/hostile_adapters.py, uploaded over HTTP."""
    tally.begin("11 adapters PEFT would refuse (NaN, ranks, layers, prefixes, configs)")
    good_config, good_weights = UPLOAD_FILES["good"]
    key = admin("alice")
    cases: list[tuple[str, bytes, bytes]] = []
    for field, raw, _ in hostile.CONFIG_VALUES:
        config = json.loads(good_config)
        config.pop(field, None)
        text = json.dumps(config)[:-1] + f', "{field}": {raw}}}'
        cases.append((f"config {field}={raw[:16]}", text.encode(), good_weights))
    for case_id, config, _ in hostile.CONFIG_FILES:
        cases.append((f"config file {case_id}", config, good_weights))
    for case in hostile.WEIGHT_FILES:
        cases.append((f"weights {case[0]}", good_config, case[1]))
    folder = stack.root / "peft-mismatch"
    for case_id, changes, edit, _, _ in hostile.PEFT_MISMATCHES:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(stack.adapter_dirs[0], folder)
        config, weights = hostile.peft_mismatch_files(folder, changes, edit)
        cases.append((f"peft {case_id}", config, weights))
    for what, config, weights in cases:
        response = await api.call("POST", "/v1/adapters", key, **upload_form("hostile", (config, weights)))
        tally.answer(response, refuse=True, what=what)
        archive = tar_gz([(hostile.CONFIG, config), (hostile.WEIGHTS, weights)])
        response = await api.call("POST", "/v1/adapters", key, **archive_form("hostile", archive))
        tally.answer(response, refuse=True, what=f"{what} (as a .tar.gz)")
    members = [(hostile.CONFIG, good_config), (hostile.WEIGHTS, good_weights)]
    for what, extra in (
        ("a member outside the folder", [("../escape.txt", b"x")]),
        ("an absolute member", [("/etc/escape.txt", b"x")]),
        ("a symlink member", [tarfile.TarInfo("link")]),
        ("a second copy of the weights", [("sub/" + hostile.WEIGHTS, good_weights)]),
    ):
        if isinstance(extra[0], tarfile.TarInfo):
            extra[0].type, extra[0].linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive = tar_gz(members + extra)
        response = await api.call("POST", "/v1/adapters", key, **archive_form("hostile", archive))
        tally.answer(response, refuse=True, what=f"archive with {what}")
    leftover = await api.call("GET", "/v1/adapters/hostile", key)
    if leftover.status_code != 404:
        tally.failed(
            "wrongly_accepted", f"a refused upload left adapter 'hostile' behind ({leftover.status_code})"
        )


def _unnamed(text: str, name: str) -> str:
    """The answer with the name asked for (and its adapter part, for name@version) taken out."""
    return text.replace(name, "N").replace(name.split("@")[0], "N")


def tar_gz(members: list) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def archive_form(name: str, archive: bytes) -> dict:
    return {"data": {"name": name}, "files": [("archive", ("adapter.tar.gz", archive, "application/gzip"))]}


async def cross_tenant(api: Api, tally: Tally) -> None:
    """bob asks for alice's adapter, versions and routes every way there is; each answer must be the one
    a name that exists nowhere gets (the name swapped), so bob learns nothing."""
    tally.begin("cross-tenant names, routes, usage, tokenizer, metrics (earlier pass)")
    alice = admin("alice")
    tally.answer(
        await api.call("POST", "/v1/adapters", alice, **upload_form("secret-bot", None)),
        refuse=False,
        what="alice's upload",
    )
    body = {"variants": [{"adapter": "secret-bot", "weight": 1}]}
    tally.answer(
        await api.call("PUT", "/v1/routes/secret-route", alice, json=body), refuse=False, what="alice's route"
    )
    probes = [
        ("POST", "/v1/completions", lambda n: {"json": {**COMPLETION, "model": n}}),
        ("POST", "/v1/chat/completions", lambda n: {"json": {**CHAT, "model": n}}),
        ("POST", "/tokenize", lambda n: {"json": {"model": n, "prompt": "hi"}}),
        ("POST", "/v1/completions", lambda n: {"json": {**COMPLETION, "model": f"alice/{n}"}}),
        ("GET", "/v1/adapters/{}", lambda n: {}),
        ("GET", "/v1/adapters/{}@1", lambda n: {}),
        ("DELETE", "/v1/adapters/{}@1", lambda n: {}),
        ("GET", "/v1/routes/{}", lambda n: {}),
        ("DELETE", "/v1/routes/{}", lambda n: {}),
        ("PUT", "/v1/routes/bobs-route", lambda n: {"json": {"variants": [{"adapter": n, "weight": 1}]}}),
        ("POST", "/v1/unload_lora_adapter", lambda n: {"json": {"lora_name": n}}),
    ]
    pairs = (
        ("secret-bot", "no-such-bot"),
        ("secret-route", "no-such-route"),
        ("secret-bot@1", "no-such-bot@1"),
    )
    for name, missing in pairs:
        for key in (admin("bob"), user("bob")):
            for method, path, kwargs in probes:
                theirs = await api.call(method, path.format(name), key, **kwargs(name))
                nobody = await api.call(method, path.format(missing), key, **kwargs(missing))
                named = "alice" in str(kwargs(name))  # bob typed alice's name himself: he may see it echoed
                hidden = () if named else ("alice",)
                tally.answer(theirs, refuse=True, what=f"bob {method} {path.format(name)}", hidden=hidden)
                tally.answer(nobody, refuse=True, what=f"bob {method} {path.format(missing)}")
                if (theirs.status_code, _unnamed(theirs.text, name)) != (
                    nobody.status_code,
                    _unnamed(nobody.text, missing),
                ):
                    tally.failed("leaks", f"{method} {path}: alice's {name!r} answers unlike a missing name")
    for path in ("/v1/models", "/v1/adapters", "/v1/routes", "/v1/usage", "/metrics"):
        response = await api.call("GET", path, admin("bob"))
        tally.answer(
            response, refuse=None, what=f"bob GET {path}", hidden=("secret-bot", "secret-route", "alice")
        )
