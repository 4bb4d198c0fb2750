"""The hostile probe's own judgement (tests/hostile/probe.py is too long for CI; its counting is not): what
counts as wrongly accepted, a 5xx, a leak or another failure, and the table it prints."""

from __future__ import annotations

import httpx
from tally import Tally

ERROR = {"error": {"message": "bad max_tokens", "type": "invalid_request_error", "code": "invalid_request"}}


def _response(status: int, body) -> httpx.Response:
    return (
        httpx.Response(status, json=body) if not isinstance(body, str) else httpx.Response(status, text=body)
    )


def test_answers_are_classified_by_what_the_input_deserved():
    tally = Tally(secrets=["/srv/state"])
    tally.begin("bad input")
    tally.answer(_response(400, ERROR), refuse=True, what="refused as it should be")
    tally.answer(_response(200, {"choices": []}), refuse=True, what="bad input accepted")
    tally.answer(_response(500, ERROR), refuse=True, what="a 5xx")
    tally.answer(_response(503, ERROR), refuse=None, what="stopping", unavailable_ok=True)
    tally.answer(_response(400, "plain text"), refuse=True, what="no OpenAI body")
    tally.answer(_response(429, ERROR), refuse=False, what="a valid request refused")
    leaky = {"error": {"message": "no file /srv/state/x", "type": "invalid_request_error", "code": "x"}}
    tally.answer(_response(400, leaky), refuse=True, what="a server path")
    echoed = {"error": {"message": "lora_path '/srv/state/mine' is outside", "type": "t", "code": "c"}}
    tally.answer(_response(400, echoed), refuse=True, what="the caller's own path", echo="/srv/state/mine")
    tally.answer(_response(404, ERROR), refuse=True, what="bob", hidden=("alice",))
    tally.answer(_response(404, {**ERROR, "x": "alice"}), refuse=True, what="alice's name", hidden=("alice",))
    row = tally.rows["bad input"]
    assert (row.tried, row.wrongly_accepted, row.server_errors, row.leaks, row.other) == (10, 1, 1, 2, 2)
    assert not tally.clean()


def test_the_table_sums_every_category():
    tally = Tally(secrets=[])
    tally.begin("a")
    tally.tried(3)
    tally.begin("b")
    tally.tried(2)
    tally.failed("stalls", "slow /health")
    lines = tally.table().splitlines()
    assert lines[0] == "| category | tried | wrongly accepted | 5xx | stalls | leaks | other |"
    assert lines[2:] == [
        "| a | 3 | 0 | 0 | 0 | 0 | 0 |",
        "| b | 2 | 0 | 0 | 1 | 0 | 0 |",
        "| **total** | **5** | **0** | **0** | **1** | **0** | **0** |",
    ]
    assert tally.failures() == ["b: slow /health"]
