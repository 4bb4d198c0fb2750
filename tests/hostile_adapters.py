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
    return len(CONFIG_VALUES) + len(CONFIG_FILES) + len(WEIGHT_FILES) + len(PEFT_MISMATCHES)


# ---- adapters PEFT would refuse, or would serve differently from the engine -----------------------------


def _edit_tensors(weights: bytes, edit) -> bytes:
    """Rewrite a safetensors file: `edit(tensors)` changes the name -> tensor dict in place."""
    from safetensors.torch import load, save

    tensors = load(weights)
    edit(tensors)
    return save(tensors)


def _set_first_value(value: float):
    def edit(tensors):
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value

    return edit


def _second_prefix(tensors):
    """Every tensor again under another prefix: the engine used to keep whichever came last."""
    for name in list(tensors):
        tensors[name.replace("base_model.model.", "other.", 1)] = tensors[name].clone() * 2


# (id, config changes, weights edit or None, code, field): for the `qv` adapter (rank 8 over q_proj and
# v_proj of both layers of the tiny Llama). None in a config change removes the key.
PEFT_MISMATCHES = [
    ("peft_type_lower_case", {"peft_type": "lora"}, None, "not_lora", "peft_type"),
    ("task_type_seq_cls", {"task_type": "SEQ_CLS"}, None, "task_type_unsupported", "task_type"),
    ("task_type_token_cls", {"task_type": "TOKEN_CLS"}, None, "task_type_unsupported", "task_type"),
    ("task_type_lower_case", {"task_type": "causal_lm"}, None, "bad_config", "task_type"),
    (
        "layer_replication",
        {"layer_replication": [[0, 2], [1, 2]]},
        None,
        "feature_unsupported",
        "layer_replication",
    ),
    ("alora", {"alora_invocation_tokens": [5, 6]}, None, "feature_unsupported", "alora_invocation_tokens"),
    ("qalora", {"use_qalora": True}, None, "feature_unsupported", "use_qalora"),
    (
        "trainable_tokens",
        {"trainable_token_indices": [1]},
        None,
        "feature_unsupported",
        "trainable_token_indices",
    ),
    (
        "layers_to_transform_0",
        {"layers_to_transform": [0]},
        None,
        "tensor_not_targeted",
        "layers_to_transform",
    ),
    (
        "layers_to_transform_int",
        {"layers_to_transform": 1},
        None,
        "tensor_not_targeted",
        "layers_to_transform",
    ),
    (
        "layers_pattern_h",
        {"layers_to_transform": [0, 1], "layers_pattern": "h"},
        None,
        "tensor_not_targeted",
        "layers_pattern",
    ),
    ("layers_pattern_alone", {"layers_pattern": "layers"}, None, "bad_config", "layers_pattern"),
    ("layers_to_transform_bad", {"layers_to_transform": ["0"]}, None, "bad_config", "layers_to_transform"),
    (
        "layers_with_regex_targets",
        {"target_modules": ".*_proj", "layers_to_transform": [0]},
        None,
        "bad_config",
        "layers_to_transform",
    ),
    ("target_modules_drop_v", {"target_modules": ["q_proj"]}, None, "tensor_not_targeted", "target_modules"),
    ("target_regex_drop_v", {"target_modules": r".*\.q_proj"}, None, "tensor_not_targeted", "target_modules"),
    ("exclude_v", {"exclude_modules": ["v_proj"]}, None, "tensor_not_targeted", "exclude_modules"),
    ("r_disagrees", {"r": 4}, None, "rank_mismatch", "r"),
    ("rank_pattern_disagrees", {"rank_pattern": {"v_proj": 4}}, None, "rank_mismatch", "rank_pattern"),
    ("second_prefix", {}, _second_prefix, "duplicate_tensor", None),
    ("nan_weight", {}, _set_first_value(float("nan")), "bad_weight_values", None),
    ("inf_weight", {}, _set_first_value(float("inf")), "bad_weight_values", None),
    ("minus_inf_weight", {}, _set_first_value(float("-inf")), "bad_weight_values", None),
    ("huge_weight", {}, _set_first_value(3e38), "bad_weight_values", None),
]
PEFT_MISMATCH_IDS = [case[0] for case in PEFT_MISMATCHES]


def peft_mismatch_files(folder: Path, changes: dict, edit) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) of `folder` with a PEFT_MISMATCHES case applied."""
    config = json.loads((folder / CONFIG).read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    weights = (folder / WEIGHTS).read_bytes()
    return json.dumps(config).encode(), weights if edit is None else _edit_tensors(weights, edit)


def write_peft_mismatch(folder: Path, changes: dict, edit) -> Path:
    """Apply a PEFT_MISMATCHES case to `folder` in place."""
    config, weights = peft_mismatch_files(folder, changes, edit)
    (folder / CONFIG).write_bytes(config)
    (folder / WEIGHTS).write_bytes(weights)
    return folder
