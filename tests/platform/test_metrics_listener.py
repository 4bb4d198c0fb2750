"""The metrics listener's flags and sockets: `--metrics-port` (default --port + 1, or off), `--metrics-host`,
`--metrics-key` from the environment; a taken default port only warns, a taken explicit port stops."""

from __future__ import annotations

import logging
import socket

import pytest
import uvicorn
from loraserve.cli import build_parser, settings_from_args
from loraserve.http_server import listening_sockets
from loraserve.settings import METRICS_OFF


def settings(argv, env=None):
    return settings_from_args(build_parser(env or {}).parse_args(["serve", *argv]))


def test_metrics_flags_and_environment():
    default = settings([])
    assert (default.metrics_listen_port, default.metrics_host, default.metrics_key) == (8001, None, None)
    assert settings(["--port", "9000"]).metrics_listen_port == 9001
    assert settings(["--metrics-port", "off"]).metrics_port == METRICS_OFF
    assert settings(["--metrics-port", "off"]).metrics_listen_port is None
    key = "k" * 24
    env = {
        "LORASERVE_METRICS_KEY": key,
        "LORASERVE_METRICS_PORT": "9100",
        "LORASERVE_METRICS_HOST": "10.0.0.5",
    }
    from_env = settings([], env)
    assert (from_env.metrics_key, from_env.metrics_listen_port, from_env.metrics_host) == (
        key,
        9100,
        "10.0.0.5",
    )
    assert settings(["--adapter-lookup-ttl", "2.5"]).adapter_lookup_ttl == 2.5


@pytest.mark.parametrize(
    "argv", [["--metrics-port", "70000"], ["--metrics-port", "8000"], ["--metrics-key", "short"]]
)
def test_bad_metrics_settings_are_refused(argv):
    with pytest.raises((SystemExit, ValueError)):
        settings(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bound_ports(sockets) -> list[int]:
    try:
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_listening_sockets_bind_the_api_and_the_metrics_port(caplog):
    port, metrics_port = free_port(), free_port()
    config = uvicorn.Config(app=None, host="127.0.0.1", port=port)
    explicit = settings(["--port", str(port), "--metrics-port", str(metrics_port)])
    assert bound_ports(listening_sockets(explicit, config)) == [port, metrics_port]
    off = settings(["--port", str(port), "--metrics-port", "off"])
    assert bound_ports(listening_sockets(off, config)) == [port]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", metrics_port))
        taken.listen()
        with pytest.raises(SystemExit, match="--metrics-port"):
            listening_sockets(explicit, config)
        with caplog.at_level(logging.WARNING):
            implicit = settings(["--port", str(metrics_port - 1)])
            implicit_config = uvicorn.Config(app=None, host="127.0.0.1", port=metrics_port - 1)
            try:
                sockets = listening_sockets(implicit, implicit_config)
            except SystemExit:  # metrics_port - 1 happened to be taken by someone else: nothing to check
                pytest.skip("the port below the taken one is in use")
            assert bound_ports(sockets) == [metrics_port - 1]
        assert "no metrics listener" in caplog.text
