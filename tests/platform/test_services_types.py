"""`Services` is typed: its annotations resolve at run time (Litestar's msgspec checks the dependency),
and the concrete parts the server builds have what each Protocol promises the handlers."""

from __future__ import annotations

import inspect
import typing

import pytest
from loraserve.ops.metrics import Metrics
from loraserve.ops.shutdown import Shutdown
from loraserve.services import EngineClient, RequestMetrics, Services, Tokenizer
from transformers import PreTrainedTokenizerBase

from engine import AsyncLLM


def test_annotations_resolve():
    hints = typing.get_type_hints(Services)
    assert hints["shutdown"] == Shutdown | None
    assert hints["metrics"] == RequestMetrics | None
    assert hints["tokenizer"] == Tokenizer | None
    assert typing.Any not in (hints["shutdown"], hints["metrics"], hints["tokenizer"])


@pytest.mark.parametrize(
    "protocol, concrete",
    [(RequestMetrics, Metrics), (EngineClient, AsyncLLM), (Tokenizer, PreTrainedTokenizerBase)],
)
def test_concrete_classes_fit_the_protocols(protocol, concrete):
    members = [
        n
        for n, v in vars(protocol).items()
        if callable(v) and (not n.startswith("_") or n in ("__call__", "__len__"))
    ]
    assert members
    for name in members:
        assert callable(getattr(concrete, name, None)), f"{concrete.__name__} has no {name}"
        wanted = [
            p for p in inspect.signature(getattr(protocol, name)).parameters if p not in ("self", "kwargs")
        ]
        have = inspect.signature(getattr(concrete, name)).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in have.values()):
            assert set(wanted) <= set(have), f"{concrete.__name__}.{name} lacks {set(wanted) - set(have)}"
