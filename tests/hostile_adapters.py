"""Malformed and hostile adapter files, one table shared by the engine, store and HTTP tests.

Each case edits a copy of a real PEFT folder: a config key set to a raw JSON text (so `1e999`, `NaN`
and 5,000-digit numbers reach the parser exactly as an attacker writes them), a whole config file
replaced, or the safetensors file rewritten. Every case must be refused with the `code` given, and,
for config keys, with `field` named in the message; none may crash or be accepted.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
HUGE_INT = "9" * 5000
MAX_LORA_RANK = 16  # what the tests' stores and engines allow

# (key, raw JSON value, code): one adapter_config.json key set to a bad value.
CONFIG_VALUES = [
    ("lora_alpha", '"abc"', "bad_alpha"),
    ("lora_alpha", "null", "bad_alpha"),
    ("lora_alpha", "[1]", "bad_alpha"),
    ("lora_alpha", "{}", "bad_alpha"),
    ("lora_alpha", "true", "bad_alpha"),
    ("lora_alpha", "1e999", "bad_alpha"),
    ("lora_alpha", "-1e999", "bad_alpha"),
    ("lora_alpha", "NaN", "bad_alpha"),
    ("lora_alpha", "Infinity", "bad_alpha"),
    ("lora_alpha", "1e7", "bad_alpha"),
    ("lora_alpha", HUGE_INT, "bad_alpha"),
    ("r", HUGE_INT, "bad_rank"),
    ("r", "true", "bad_rank"),
    ("r", '"8"', "bad_rank"),
    ("r", "8.5", "bad_rank"),
    ("r", "8.0", "bad_rank"),
    ("r", "0", "bad_rank"),
    ("r", "-8", "bad_rank"),
    ("r", "null", "bad_rank"),
    ("r", "[8]", "bad_rank"),
    ("r", "1" + "0" * 30, "rank_too_large"),
    ("rank_pattern", '"q_proj"', "bad_rank_pattern"),
    ("rank_pattern", "[8]", "bad_rank_pattern"),
    ("rank_pattern", "8", "bad_rank_pattern"),
    ("rank_pattern", '{"q_proj": "abc"}', "bad_rank_pattern"),
    ("rank_pattern", '{"q_proj": true}', "bad_rank_pattern"),
    ("rank_pattern", '{"q_proj": 0}', "bad_rank_pattern"),
    ("rank_pattern", '{"q_proj": 4.5}', "bad_rank_pattern"),
    ("rank_pattern", '{"q_proj": null}', "bad_rank_pattern"),
    ("rank_pattern", '{"q_proj": ' + HUGE_INT + "}", "bad_rank_pattern"),
    ("rank_pattern", '{"": 4}', "bad_rank_pattern"),
    ("rank_pattern", '{"q_proj": 64}', "rank_too_large"),
    ("alpha_pattern", '"q_proj"', "bad_alpha_pattern"),
    ("alpha_pattern", "[16]", "bad_alpha_pattern"),
    ("alpha_pattern", '{"q_proj": "x"}', "bad_alpha_pattern"),
    ("alpha_pattern", '{"q_proj": 1e999}', "bad_alpha_pattern"),
    ("alpha_pattern", '{"q_proj": NaN}', "bad_alpha_pattern"),
    ("alpha_pattern", '{"q_proj": null}', "bad_alpha_pattern"),
    ("alpha_pattern", '{"q_proj": [1]}', "bad_alpha_pattern"),
    ("alpha_pattern", '{"(": 16}', "bad_alpha_pattern"),
    ("alpha_pattern", '{"((a{1000}){1000}){1000}": 16}', "bad_alpha_pattern"),  # compiling it takes minutes
    ("alpha_pattern", '{"' + "q" * 300 + '": 16}', "bad_alpha_pattern"),
    ("use_rslora", '"yes"', "bad_config"),
    ("use_rslora", "1", "bad_config"),
    ("use_rslora", "[]", "bad_config"),
    ("use_dora", '"no"', "bad_config"),
    ("fan_in_fan_out", '"false"', "bad_config"),
    ("lora_bias", "0", "bad_config"),
    ("bias", "5", "bad_config"),
    ("bias", '"some"', "bad_config"),
    ("target_modules", "5", "bad_config"),
    ("target_modules", "[1, 2]", "bad_config"),
    ("target_modules", '{"q_proj": 1}', "bad_config"),
    ("target_modules", '["q_proj", null]', "bad_config"),
    ("target_modules", '"' + "q" * 300 + '"', "bad_config"),
    ("modules_to_save", "5", "bad_config"),
    ("modules_to_save", '"lm_head"', "bad_config"),
    ("base_model_name_or_path", "5", "bad_config"),
    ("base_model_name_or_path", '"' + "x" * 2000 + '"', "bad_config"),
    ("peft_type", "5", "not_lora"),
    ("peft_type", "null", "not_lora"),
]
CONFIG_VALUE_IDS = [f"{key}={raw[:12]}" for key, raw, _ in CONFIG_VALUES]

# (id, the whole adapter_config.json, message fragment): all refused with code bad_config
CONFIG_FILES = [
    (
        "nested_200k_arrays",
        b'{"peft_type": "LORA", "r": 8, "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
        "levels deep",
    ),
    (
        "nested_100k_objects",
        b'{"peft_type": "LORA", "x": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
        "levels deep",
    ),
    ("nested_200k_unclosed", b"[" * 200_000, "levels deep"),
    ("nested_9_levels", b'{"peft_type": "LORA", "x": ' + b"[" * 8 + b"]" * 8 + b"}", "levels deep"),
    ("not_utf8", b'{"peft_type": "LORA\xff"}', "not UTF-8"),
    ("not_an_object", b"[1, 2]", "must hold a JSON object"),
    ("a_string", b'"LORA"', "must hold a JSON object"),
    ("empty", b"", "not valid JSON"),
    ("huge_number_only", HUGE_INT.encode(), "must hold a JSON object"),
]
CONFIG_FILE_IDS = [case[0] for case in CONFIG_FILES]


def _header_file(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _one_tensor(name: str, shape: list, data_bytes: int | None = None) -> bytes:
    count = 4 * (shape[0] * shape[1] if len(shape) == 2 else 1)
    header = json.dumps({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, count]}}).encode()
    return _header_file(header, b"\0" * (count if data_bytes is None else data_bytes))


_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _pair(shape_a: list, shape_b: list) -> bytes:
    entries, offset = {}, 0
    for name, shape in ((_A, shape_a), (_B, shape_b)):
        size = 4 * _prod(shape)
        entries[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return _header_file(json.dumps(entries).encode(), b"\0" * offset)


def _prod(shape: list) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# (id, the whole adapter_model.safetensors, code, message fragment)
WEIGHT_FILES = [
    ("header_100k_nested_arrays", _header_file(b"[" * 100_000), "bad_weights", "levels deep"),
    ("header_100k_nested_closed", _header_file(b"[" * 50_000 + b"]" * 50_000), "bad_weights", "levels deep"),
    (
        "header_nested_objects",
        _header_file(b'{"a": ' * 30_000 + b"1" + b"}" * 30_000),
        "bad_weights",
        "levels deep",
    ),
    (
        "header_huge_dimension",
        _header_file(
            f'{{"{_A}": {{"dtype": "F32", "shape": [{HUGE_INT}], "data_offsets": [0, 4]}}}}'.encode()
        ),
        "bad_weights",
        "5000-digit number",
    ),
    (
        "header_duplicate_keys",
        _header_file(b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": 1}', b"\0" * 4),
        "bad_weights",
        "duplicate keys",
    ),
    ("scalar_lora_a", _pair([], [64, 8]), "shape_mismatch", "must be [rank, 64]"),
    ("rank_zero", _pair([0, 64], [64, 0]), "shape_mismatch", "rank >= 1"),
    (
        "layer_index_5000_digits",
        _one_tensor(f"base_model.model.model.layers.{HUGE_INT}.self_attn.q_proj.lora_A.weight", [8, 64]),
        "unexpected_tensor",
        "is not a LoRA weight",
    ),
    (
        "tensor_name_100k_chars",
        _one_tensor("x" * 100_000 + ".layers.0.self_attn.q_proj.lora_A.weight", [8, 64]),
        "unexpected_tensor",
        "...",
    ),
]
WEIGHT_FILE_IDS = [case[0] for case in WEIGHT_FILES]


def with_config_value(folder: Path, key: str, raw: str) -> Path:
    """Set `key` of the folder's adapter_config.json to the raw JSON text `raw` (in place)."""
    path = folder / CONFIG
    config = json.loads(path.read_text())
    config.pop(key, None)
    body = json.dumps(config)
    path.write_text(body[:-1] + f', "{key}": {raw}}}')
    return folder


def bad_config_value_params():
    return [
        pytest.param(key, raw, code, id=case_id)
        for (key, raw, code), case_id in zip(CONFIG_VALUES, CONFIG_VALUE_IDS, strict=True)
    ]


def num_bad_inputs() -> int:
    """How many distinct bad inputs the tables hold (the closing note's count)."""
    return len(CONFIG_VALUES) + len(CONFIG_FILES) + len(WEIGHT_FILES)
