"""A model's generation_config.json gives the defaults of unset sampling fields (vLLM's `--generation-config`)."""

from __future__ import annotations

import json
import logging

import pytest

from engine.generation_config import apply_generation_defaults, load_generation_defaults
from engine.sampling_params import SamplingParams


def _model(tmp_path, config: dict | str):
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_supported_fields_are_read_and_the_rest_ignored(tmp_path, caplog):
    folder = _model(
        tmp_path,
        {
            "temperature": 0.2,
            "top_p": 0.9,
            "top_k": 40,
            "repetition_penalty": 1.1,
            "min_p": 0.05,
            "do_sample": True,
            "max_new_tokens": 99,
            "eos_token_id": 2,
        },
    )
    with caplog.at_level(logging.INFO, logger="engine.generation_config"):
        assert load_generation_defaults(folder) == {
            "temperature": 0.2,
            "top_p": 0.9,
            "top_k": 40,
            "repetition_penalty": 1.1,
            "min_p": 0.05,
        }
    assert "sampling defaults" in caplog.text


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"bos_token_id": 1, "eos_token_id": 2},  # what a plain conversion writes
        "not json",
        "[1, 2]",
        {
            "temperature": -1,
            "top_p": 0,
            "top_k": 1.5,
            "min_p": 2,
            "repetition_penalty": 0,
        },  # ignored, not refused
        {"temperature": True, "top_p": "0.9"},
    ],
)
def test_no_usable_defaults_means_none(tmp_path, config):
    assert load_generation_defaults(_model(tmp_path, config)) == {}


def test_no_file_and_vllm_mode_mean_no_defaults(tmp_path):
    assert load_generation_defaults(tmp_path) == {}
    assert load_generation_defaults(_model(tmp_path, {"temperature": 0.2}), "vllm") == {}
    with pytest.raises(ValueError, match="generation_config must be one of auto, vllm"):
        load_generation_defaults(tmp_path, "hf")


def test_unset_fields_take_the_defaults_and_set_ones_win():
    defaults = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.3}
    params = apply_generation_defaults(
        defaults,
        temperature=None,
        top_p=None,
        top_k=None,
        min_p=None,
        repetition_penalty=None,
        max_tokens=None,
    )
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.9, 0, None)
    assert (params.repetition_penalty, params.min_p) == (1.3, 0.0)
    params = apply_generation_defaults(defaults, temperature=0.0, top_p=1.0, top_k=5, max_tokens=8)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 1.0, 5, 8)
    plain = apply_generation_defaults({})
    assert (plain.temperature, plain.top_p, plain.top_k) == (
        SamplingParams().temperature,
        SamplingParams().top_p,
        SamplingParams().top_k,
    )


def test_offline_llm_uses_the_models_defaults(text_model_dir, tmp_path):
    import shutil

    from engine import LLM

    folder = tmp_path / "model"
    shutil.copytree(text_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 3}))
    llm = LLM(model=str(folder), max_model_len=64, block_size=4)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 3, 1.0)
    # No sampling_params: the model's (greedy) defaults, so the same tokens as an explicit greedy request.
    unset = llm.generate(["Hello world", "Hello world"])
    greedy = llm.generate(["Hello world"], SamplingParams(temperature=0.0))
    assert [o.outputs[0].token_ids for o in unset] == [greedy[0].outputs[0].token_ids] * 2

    ignored = LLM(model=str(folder), max_model_len=64, block_size=4, generation_config="vllm")
    assert ignored.get_default_sampling_params() == SamplingParams()
