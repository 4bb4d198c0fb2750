"""`loraserve adapters|routes ...` against the real app (Litestar's TestClient is an httpx.Client)."""

from __future__ import annotations

import json
import tarfile

import pytest
from api_env import ADMIN_A, USER_A, free_port_for_cli
from litestar.testing import TestClient
from loraserve import cli, cli_client


@pytest.fixture
def client(api_env):
    with TestClient(api_env().app) as client:
        yield client


@pytest.fixture
def run(client, capsys, monkeypatch):
    """run(*argv) -> (exit code, parsed stdout JSON or None, stderr) with the admin key in the environment."""
    monkeypatch.setenv(cli_client.KEY_ENV, ADMIN_A)

    def run(*argv):
        code = cli_client.main(list(argv), client=client)
        out, err = capsys.readouterr()
        return code, (json.loads(out) if out.strip() else None), err

    return run


def test_adapter_commands(run, peft_adapters, tmp_path):
    archive = tmp_path / "bot.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(peft_adapters["all"], arcname="bot")
    code, record, _ = run("adapters", "upload", "bot", str(peft_adapters["qv"]))
    assert (code, record["name"], record["version"], record["rank"]) == (0, "bot", 1, 8)
    code, record, _ = run("adapters", "upload", "bot", str(archive))
    assert (code, record["version"], record["rank"]) == (0, 2, 4)
    assert [a["version"] for a in run("adapters", "list")[1]["data"]] == [2]
    assert [v["version"] for v in run("adapters", "get", "bot")[1]["versions"]] == [1, 2]
    code, deleted, _ = run("adapters", "delete", "bot@1")
    assert (code, deleted["versions"]) == (0, [1])
    code, _, err = run("adapters", "get", "bot@1")
    assert code == 1 and "HTTP 404 (adapter_not_found)" in err


def test_route_commands(run, peft_adapters):
    run("adapters", "upload", "a", str(peft_adapters["qv"]))
    run("adapters", "upload", "b", str(peft_adapters["qv"]))
    code, route, _ = run(
        "routes", "set", "exp", "--variant", "a=90", "--variant", "b@1=10", "--sticky", "none"
    )
    assert code == 0
    assert route == {
        "name": "exp",
        "variants": [{"adapter": "a", "weight": 90}, {"adapter": "b@1", "weight": 10}],
        "sticky": "none",
    }
    assert run("routes", "get", "exp")[1] == route
    assert run("routes", "list")[1]["data"] == [route]
    code, _, err = run("routes", "set", "bad", "--variant", "missing=1")
    assert code == 1 and "HTTP 422 (invalid_route)" in err and "variants[0].adapter 'missing'" in err
    code, _, err = run("routes", "set", "zero", "--variant", "a=0")
    assert code == 1 and "positive integer" in err
    assert run("routes", "delete", "exp")[0] == 0
    assert run("routes", "list")[1]["data"] == []


def test_errors_are_one_line_and_exit_1(run, peft_adapters, tmp_path):
    code, _, err = run("adapters", "upload", "bot", str(peft_adapters["qv"]), "--api-key", USER_A)
    assert code == 1 and err.startswith("error: HTTP 403 (insufficient_permissions)")
    code, _, err = run("adapters", "list", "--api-key", "sk-wrong")
    assert code == 1 and "HTTP 401 (invalid_api_key)" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run("adapters", "upload", "bot", str(empty))
    assert code == 1 and "adapter_config.json or adapter_model.safetensors" in err
    code, _, err = run("adapters", "upload", "bot", str(tmp_path / "nope"))
    assert code == 1 and "does not exist" in err
    code, _, err = run("adapters", "delete", "../../v1/routes/x")
    assert code == 1 and "not a valid name" in err


@pytest.mark.parametrize("spec", ["a", "a=", "=5", "a=ten", "a=-1"])
def test_bad_variant_is_a_usage_error(run, spec, capsys):
    with pytest.raises(SystemExit) as caught:
        run("routes", "set", "r", "--variant", spec)
    assert caught.value.code == 2
    assert "ADAPTER=WEIGHT" in capsys.readouterr().err


def test_loraserve_cli_has_the_client_commands_and_reports_an_unreachable_server(capsys):
    url = f"http://127.0.0.1:{free_port_for_cli()}"  # nothing listens there
    assert cli.main(["routes", "list", "--url", url, "--api-key", "k"]) == 1
    assert f"cannot talk to the server at {url}" in capsys.readouterr().err
