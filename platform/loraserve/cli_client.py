"""`loraserve adapters ...` and `loraserve routes ...`: a thin command-line client of the admin HTTP API.

    loraserve adapters upload NAME PATH [--tool-call-parser P]   PATH: a PEFT folder, or a .tar.gz / .zip
    loraserve adapters list | get NAME[@V] | delete NAME[@V]
    loraserve routes set NAME --variant a=90 --variant b@2=10 [--sticky user|none]
    loraserve routes list | get NAME | delete NAME

Every command takes `--url` (env LORASERVE_URL, default http://127.0.0.1:8000) and `--api-key`
(env LORASERVE_API_KEY), prints the server's JSON answer, and on an HTTP error prints the server's
message to stderr and exits with 1. Uploads stream from disk; nothing is read whole into memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from adapter_format.files import ADAPTER_FILES

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV, KEY_ENV = "LORASERVE_URL", "LORASERVE_API_KEY"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip")
# Uploads of large adapters over slow links need long read/write windows; connecting should be quick.
TIMEOUT = httpx.Timeout(600.0, connect=10.0)


class ClientError(Exception):
    """A problem to report in one line on stderr (exit code 1)."""


def add_client_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `adapters` and `routes` to the `loraserve` parser; each leaf sets `func(args) -> exit code`."""
    adapters = subparsers.add_parser("adapters", help="upload, list and delete adapters (admin API client)")
    adapter_commands = adapters.add_subparsers(dest="adapters_command", required=True, metavar="COMMAND")
    upload = _leaf(adapter_commands, "upload", "upload a PEFT folder or archive (a new version)", _upload)
    upload.add_argument("name", help="the adapter's name; an existing name gets a new version")
    upload.add_argument("path", type=Path, help="a PEFT adapter folder, or a .tar.gz/.zip of one")
    upload.add_argument(
        "--tool-call-parser",
        help="the format this adapter writes tool calls in (hermes, llama3_json, mistral, pythonic): "
        'tool_choice "auto" then parses its output with it',
    )
    _leaf(adapter_commands, "list", "list your adapters (latest version of each)", _list_adapters)
    get = _leaf(adapter_commands, "get", "show an adapter and its versions", _get_adapter)
    get.add_argument("ref", metavar="NAME[@VERSION]")
    remove = _leaf(
        adapter_commands, "delete", "delete an adapter, or one version with NAME@VERSION", _delete_adapter
    )
    remove.add_argument("ref", metavar="NAME[@VERSION]")

    routes = subparsers.add_parser("routes", help="set, list and delete A/B routes (admin API client)")
    route_commands = routes.add_subparsers(dest="routes_command", required=True, metavar="COMMAND")
    route_set = _leaf(route_commands, "set", "create or replace a route", _set_route)
    route_set.add_argument("name")
    route_set.add_argument(
        "--variant",
        dest="variants",
        action="append",
        required=True,
        type=parse_variant,
        metavar="ADAPTER=WEIGHT",
        help="an adapter (name or name@version) and its integer weight; repeat for each variant",
    )
    route_set.add_argument("--sticky", choices=("user", "none"), default="user", help="default: user")
    _leaf(route_commands, "list", "list your routes", _list_routes)
    route_get = _leaf(route_commands, "get", "show one route", _get_route)
    route_get.add_argument("name")
    route_delete = _leaf(route_commands, "delete", "delete a route", _delete_route)
    route_delete.add_argument("name")


def parse_variant(spec: str) -> dict[str, Any]:
    """`b@2=10` -> {"adapter": "b@2", "weight": 10}; the server checks the rest."""
    adapter, sep, weight = spec.rpartition("=")
    if not sep or not adapter or not weight.strip().isdigit():
        raise argparse.ArgumentTypeError(
            f"{spec!r}: expected ADAPTER=WEIGHT with an integer weight, e.g. a=90"
        )
    return {"adapter": adapter.strip(), "weight": int(weight)}


def main(argv: Sequence[str] | None = None, *, client: httpx.Client | None = None) -> int:
    """The client commands alone (what `loraserve adapters|routes ...` runs); `client` for tests."""
    parser = argparse.ArgumentParser(prog="loraserve")
    add_client_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return args.func(args, client=client)


def _leaf(
    commands: argparse._SubParsersAction, name: str, summary: str, action: Callable
) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=summary, description=summary)
    parser.add_argument("--url", help=f"server address (env {URL_ENV}; default {DEFAULT_URL})")
    parser.add_argument("--api-key", help=f"an admin key of your tenant (env {KEY_ENV})")
    parser.set_defaults(func=lambda args, client=None: _run(action, args, client))
    return parser


def _run(action: Callable, args: argparse.Namespace, client: httpx.Client | None) -> int:
    """Call the server, print its answer; errors go to stderr as one line with exit code 1."""
    url = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    key = args.api_key or os.environ.get(KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with ExitStack() as stack:
            if client is None:
                client = stack.enter_context(httpx.Client(base_url=url, timeout=TIMEOUT))
            response = action(client, args, headers)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:  # connection refused, timeouts, bad URL
        print(f"error: cannot talk to the server at {url}: {exc}", file=sys.stderr)
        return 1
    if response.is_error:
        print(f"error: {_describe_error(response)}", file=sys.stderr)
        return 1
    print(json.dumps(response.json(), indent=2))
    return 0


def _describe_error(response: httpx.Response) -> str:
    """`HTTP 422 (invalid_adapter): message` from OpenAI's error body, or the raw text."""
    try:
        error = response.json()["error"]
        return f"HTTP {response.status_code} ({error.get('code')}): {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text.strip()[:500]}"


def _upload(client: httpx.Client, args: argparse.Namespace, headers: dict) -> httpx.Response:
    path: Path = args.path
    with ExitStack() as stack:
        if path.is_dir():
            missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
            if missing:
                raise ClientError(f"{path} has no {' or '.join(missing)}; is it a PEFT adapter folder?")
            files = [("files", (f, stack.enter_context(open(path / f, "rb")))) for f in ADAPTER_FILES]
        elif path.is_file():
            if not path.name.lower().endswith(ARCHIVE_SUFFIXES):
                raise ClientError(f"{path} is neither a folder nor a .tar.gz/.zip archive")
            files = [("archive", (path.name, stack.enter_context(open(path, "rb"))))]
        else:
            raise ClientError(f"{path} does not exist")
        data = {"name": args.name}
        if args.tool_call_parser:
            data["tool_call_parser"] = args.tool_call_parser
        return client.post("/v1/adapters", data=data, files=files, headers=headers)


def _list_adapters(client: httpx.Client, args: argparse.Namespace, headers: dict) -> httpx.Response:
    return client.get("/v1/adapters", headers=headers)


def _get_adapter(client: httpx.Client, args: argparse.Namespace, headers: dict) -> httpx.Response:
    return client.get(f"/v1/adapters/{_segment(args.ref)}", headers=headers)


def _delete_adapter(client: httpx.Client, args: argparse.Namespace, headers: dict) -> httpx.Response:
    return client.delete(f"/v1/adapters/{_segment(args.ref)}", headers=headers)


def _set_route(client: httpx.Client, args: argparse.Namespace, headers: dict) -> httpx.Response:
    body = {"variants": args.variants, "sticky": args.sticky}
    return client.put(f"/v1/routes/{_segment(args.name)}", json=body, headers=headers)


def _list_routes(client: httpx.Client, args: argparse.Namespace, headers: dict) -> httpx.Response:
    return client.get("/v1/routes", headers=headers)


def _get_route(client: httpx.Client, args: argparse.Namespace, headers: dict) -> httpx.Response:
    return client.get(f"/v1/routes/{_segment(args.name)}", headers=headers)


def _delete_route(client: httpx.Client, args: argparse.Namespace, headers: dict) -> httpx.Response:
    return client.delete(f"/v1/routes/{_segment(args.name)}", headers=headers)


def _segment(name: str) -> str:
    """One URL path segment: a name with '/' or '?' must not reach another endpoint."""
    if not name or any(c in name for c in "/?#%") or name in (".", ".."):
        raise ClientError(
            f"{name!r} is not a valid name (letters, digits, '.', '_', '-', and '@' before a version)"
        )
    return name
