"""`loraserve serve` (the server, under uvicorn) and the admin client commands (`loraserve adapters|routes`).

Every serve flag can also come from the environment: `--max-loras` from `LORASERVE_MAX_LORAS`,
`--lora-modules` from `LORASERVE_LORA_MODULES` (space or comma separated), booleans as
true/false/1/0/yes/no. A flag on the command line wins over its variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import Field, fields
from pathlib import Path

from engine.engine_args import EngineArgs, Flag, flag_name, flag_of
from loraserve.http_server import run_app
from loraserve.settings import ServerSettings

ENV_PREFIX = "LORASERVE_"
IMAGE_VARIANT_ENV = "IMAGE_VARIANT"  # cuda or cpu, set by deploy/Dockerfile
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of ServerSettings that has a Flag: the server's own, then the engine's
    (engine.engine_args), each with its field's default, choices and help."""
    server = parser.add_argument_group("server")
    engine = parser.add_argument_group("engine", "the engine core's sizes and limits (vLLM's flags)")
    hints = typing.get_type_hints(ServerSettings)
    engine_fields = {f.name for f in fields(EngineArgs)}
    for f in sorted(fields(ServerSettings), key=lambda f: f.name in engine_fields):  # the server's first
        flag = flag_of(f)
        if flag is not None:
            group = engine if f.name in engine_fields else server
            group.add_argument(flag_name(f), dest=_dest(f), **_flag_options(f, flag, hints[f.name]))
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _flag_options(f: Field, flag: Flag, hint: object) -> dict[str, object]:
    options: dict[str, object] = {"default": f.default, "help": flag.help}
    if flag.metavar is not None:
        options["metavar"] = flag.metavar
    kind = _value_type(hint)
    if kind is bool:
        options["action"] = flag.action or argparse.BooleanOptionalAction
        return options
    if flag.nargs is not None:
        options["nargs"] = flag.nargs
    parse = flag.parse or (kind if kind in (int, float, Path) else None)
    if parse is not None:
        options["type"] = parse
    choices = f.metadata.get("choices")
    if choices is not None:
        options["choices"] = [choice for choice in choices if choice is not None]
    return options


def _value_type(hint: object) -> object:
    """int for `int | None`; str for a union of several types (JSON text on the command line)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return hint


def _dest(f: Field) -> str:
    """The argparse name (and so LORASERVE_<NAME>): the flag's, which a field's name may differ from."""
    return flag_name(f).removeprefix("--").replace("-", "_")


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Make `LORASERVE_<FLAG>` the default of each flag, so the command line still wins."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = ENV_PREFIX + action.dest.upper()
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            action.default = _env_value(action, raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{name}={raw!r}: {exc}")


def _env_value(action: argparse.Action, raw: str) -> object:
    # --x/--no-x switches and on-only ones (store_true: nargs 0, a bool const) read true or false alike
    if isinstance(action, argparse.BooleanOptionalAction) or (action.nargs == 0 and action.const is True):
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            raise ValueError("expected true or false")
        return value in _TRUE
    convert = action.type or str
    if action.nargs == "+":
        return [convert(item) for item in raw.replace(",", " ").split()]
    if action.choices is not None and raw not in action.choices:
        raise ValueError(f"expected one of {', '.join(action.choices)}")
    return convert(raw)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    values = {}
    for f in fields(ServerSettings):
        if flag_of(f) is not None:
            value = getattr(args, _dest(f))
            values[f.name] = tuple(value) if isinstance(value, list) else value  # nargs="+" settings
    return ServerSettings(**values)


def serve(settings: ServerSettings, log_level: str = "info") -> int:
    """Run the server until SIGTERM (exit code 0) or until the engine core dies (1)."""
    from loraserve.app import create_app  # the app pulls in torch: only for `serve`
    from loraserve.frontends.placement import api_server_count, cpu_plan

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_device(settings.device, os.environ.get(IMAGE_VARIANT_ENV))
    if api_server_count(settings) > 1:  # a supervisor, the engine core and N front-end processes
        from loraserve.frontends.supervisor import Supervisor

        return Supervisor(settings, log_level).run()
    plan = cpu_plan(settings)
    if plan is not None:  # this process and what it starts stay off the engine core's CPUs
        from engine.core.steady import pin_process

        pin_process(plan.others)
    return run_app(create_app(settings), settings, log_level)


def check_device(device: str, image_variant: str | None) -> None:
    """Refuse --device cuda without a visible GPU, before anything loads (the CUDA image sets it, so it
    never quietly serves from the CPU); say so when this is the CPU image."""
    log = logging.getLogger("loraserve")
    if image_variant == "cpu":
        log.warning("this is the CPU image (no CUDA): fine for trying loraserve, slow for serving")
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        where = (
            "run the container with --gpus all (needs the NVIDIA Container Toolkit on the host), use the "
            "CPU image, or set LORASERVE_DEVICE=cpu"
            if image_variant
            else "pass --device cpu (or auto) to serve from the CPU"
        )
        raise SystemExit(f"--device {device}: no CUDA device is visible to this process; {where}")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraserve", description="Serve many LoRA adapters of one base model."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser("serve", help="run the OpenAI-compatible server")
    add_serve_arguments(serve_parser)
    apply_env_defaults(serve_parser, os.environ if environ is None else environ)
    _add_client_commands(commands)
    from loraserve.placement.command import add_placement_command  # httpx and prometheus_client only

    add_placement_command(
        commands, lambda p, _: apply_env_defaults(p, os.environ if environ is None else environ)
    )
    return parser


def _add_client_commands(commands: argparse._SubParsersAction) -> None:
    try:
        from loraserve.cli_client import add_client_commands
    except ImportError:  # the admin client is optional for `serve`
        return
    add_client_commands(commands)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            settings = settings_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
        return serve(settings, args.log_level)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
