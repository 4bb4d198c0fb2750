"""adapter_config.json rules (adapter_format.peft_config) and the bounded JSON reader, table-driven;
then the engine's own paths: a malformed folder given to `LLM(lora_modules=...)` or per request."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from hostile_adapters import (
    CONFIG,
    CONFIG_FILE_IDS,
    CONFIG_FILES,
    MAX_LORA_RANK,
    WEIGHT_FILE_IDS,
    WEIGHT_FILES,
    WEIGHTS,
    bad_config_value_params,
    with_config_value,
)

from adapter_format import checkpoint as peft_checkpoint
from adapter_format import module_patterns
from adapter_format.bounded_json import LongNumber, loads_bounded, nesting_depth_exceeds
from adapter_format.peft_config import check_adapter_config, parse_adapter_config
from engine import LLM, AdapterError, SamplingParams

GOOD = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
    "bias": "none",
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "base_model_name_or_path": "tiny",
}


def config_text(key: str, raw: str) -> bytes:
    body = json.dumps({k: v for k, v in GOOD.items() if k != key})
    return (body[:-1] + f', "{key}": {raw}}}').encode()


@pytest.mark.parametrize(("key", "raw", "code"), bad_config_value_params())
def test_each_bad_value_is_refused_naming_its_field(key, raw, code):
    with pytest.raises(AdapterError) as err:
        check_adapter_config(parse_adapter_config(config_text(key, raw)), MAX_LORA_RANK)
    assert (err.value.code, err.value.field) == (code, key)
    assert key in str(err.value)
    assert len(str(err.value)) < 400, "a message never echoes a whole hostile value"


@pytest.mark.parametrize(("case_id", "data", "fragment"), CONFIG_FILES, ids=CONFIG_FILE_IDS)
def test_malformed_config_files_are_adapter_errors(case_id, data, fragment):
    with pytest.raises(AdapterError, match=fragment) as err:
        parse_adapter_config(data)
    assert err.value.code == "bad_config"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, dict(rank=8, alpha=16.0, use_rslora=False)),
        ({"lora_alpha": 8.5, "use_rslora": True}, dict(alpha=8.5, use_rslora=True)),
        ({"lora_alpha": -4}, dict(alpha=-4.0)),
        ({"use_rslora": None, "use_dora": None, "bias": None}, dict(use_rslora=False)),
        ({"target_modules": "all-linear"}, dict(target_modules="all-linear")),
        ({"target_modules": None}, dict(target_modules=None)),
        ({"rank_pattern": {"q_proj": 16}, "alpha_pattern": {"v_proj": 4}}, dict(rank_pattern={"q_proj": 16})),
        ({"lora_dropout": "ignored", "task_type": "CAUSAL_LM"}, dict(rank=8)),  # lora_dropout: never read
    ],
)
def test_valid_configs_pass_with_their_values(changes, expected):
    config = {**GOOD, **changes}
    for key in [k for k, v in changes.items() if v is None and k not in GOOD]:
        config.pop(key)
    settings = check_adapter_config(config, MAX_LORA_RANK)
    assert {k: getattr(settings, k) for k in expected} == expected


def test_a_catastrophic_alpha_pattern_regex_fails_in_bounded_time(monkeypatch):
    # This regex backtracks for minutes on a module name under Python's `re` (what PEFT uses).
    config = {**GOOD, "alpha_pattern": {"(?:(?:.|.)*?)*?(?!j).": 4}}
    monkeypatch.setattr(module_patterns, "PATTERN_MATCH_BUDGET_S", 0.05)
    shapes = {
        f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": s
        for ab, s in (("A", (8, 64)), ("B", (64, 8)))
    }
    shape = peft_checkpoint.ModelShape(2, 64, 128, 4, 2, 16)
    started = time.monotonic()
    with pytest.raises(AdapterError, match="takes too long to match") as err:
        peft_checkpoint.check_adapter(config, shapes, shape, MAX_LORA_RANK)
    assert time.monotonic() - started < 30
    assert (err.value.code, err.value.field) == ("bad_alpha_pattern", "alpha_pattern")


@pytest.mark.parametrize(
    ("data", "max_depth", "exceeds"),
    [
        (b"{}", 1, False),
        (b"[[]]", 1, True),
        (b"[[]]", 2, False),
        (b'{"a": [1, {"b": []}]}', 4, False),
        (b'{"a": [1, {"b": []}]}', 3, True),
        (b'["[[[[[[", "]]"]', 1, False),  # brackets inside strings do not count
        (b'["\\"[[[[", "\\\\"]', 1, False),  # nor after escaped quotes and backslashes
        (b"[[], [], [[]], []]", 3, False),
        (b"[[], [], [[]], []]", 2, True),
        (b"[" * 100, 64, True),
        (b"[" * 64 + b"]" * 64, 64, False),
        (b"[" * 65 + b"]" * 65, 64, True),
        (b"]]][[[", 8, True),  # unbalanced
    ],
)
def test_nesting_depth(data, max_depth, exceeds):
    assert nesting_depth_exceeds(data, max_depth) is exceeds


def test_loads_bounded_keeps_long_numbers_as_their_length():
    value = loads_bounded(b'{"r": ' + b"9" * 5000 + b', "n": -12}', 4)
    assert isinstance(value["r"], LongNumber) and repr(value["r"]) == "a 5000-digit number"
    assert value["n"] == -12
    with pytest.raises(ValueError, match="levels deep"):
        loads_bounded(b"[" * 200_000 + b"]" * 200_000, 8)


# ---- the engine's own paths -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(text_model_dir, text_adapters):
    return LLM(
        model=str(text_model_dir),
        lora_modules={"alpha": str(text_adapters["alpha"])},
        max_loras=2,
        max_lora_rank=8,
        max_model_len=64,
        block_size=4,
        max_num_seqs=8,
    )


def _copy(folder, tmp_path, name):
    dest = tmp_path / name
    shutil.copytree(folder, dest)
    return dest


@pytest.mark.parametrize(
    ("key", "raw"), [("lora_alpha", '"abc"'), ("lora_alpha", "1e999"), ("r", "true"), ("rank_pattern", "[1]")]
)
def test_lora_modules_with_a_bad_config_raise_an_adapter_error_naming_the_field(
    text_model_dir, text_adapters, tmp_path, key, raw
):
    folder = with_config_value(_copy(text_adapters["alpha"], tmp_path, "bad"), key, raw)
    with pytest.raises(AdapterError, match=key) as err:
        LLM(model=str(text_model_dir), lora_modules={"bad": str(folder)}, max_lora_rank=8, max_model_len=64)
    assert err.value.field == key


def test_per_request_bad_folders_fail_alone(llm, text_adapters, tmp_path):
    bad_configs = [
        with_config_value(_copy(text_adapters["alpha"], tmp_path, f"c{i}"), key, raw)
        for i, (key, raw) in enumerate(
            [("lora_alpha", "null"), ("use_rslora", '"yes"'), ("target_modules", "5")]
        )
    ]
    deep = _copy(text_adapters["alpha"], tmp_path, "deep")
    (deep / CONFIG).write_bytes(CONFIG_FILES[0][1])
    bad_weights = []
    for case_id, data, _, _ in WEIGHT_FILES[:3]:
        folder = _copy(text_adapters["alpha"], tmp_path, case_id)
        (folder / WEIGHTS).write_bytes(data)
        bad_weights.append(folder)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    adapters = ["alpha", *map(str, bad_configs), str(deep), *map(str, bad_weights), None]
    outputs = llm.generate(["hello"] * len(adapters), params, adapters=adapters)
    errors = [o.error for o in outputs]
    assert errors[0] is None and errors[-1] is None
    for error, fragment in zip(
        errors[1:-1],
        ["lora_alpha", "use_rslora", "target_modules", "levels deep", *["safetensors"] * 3],
        strict=True,
    ):
        assert error is not None and fragment in error
    assert llm.generate(["hello"], params, adapters=["alpha"])[0].error is None  # still serving


assert len(WEIGHT_FILE_IDS) == len(WEIGHT_FILES)
