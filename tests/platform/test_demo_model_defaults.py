"""The demo model folder carries the model card's sampling defaults, also when it was converted earlier."""

from __future__ import annotations

import json

from loraserve.demo_model import DEMO_MODEL_NAME, SAMPLING_DEFAULTS, ensure_demo_model

from engine.generation_config import load_generation_defaults


def test_an_earlier_conversion_gets_the_sampling_defaults(tmp_path):
    folder = tmp_path / DEMO_MODEL_NAME
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # converted: ensure_demo_model converts nothing
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert ensure_demo_model(tmp_path) == folder
    written = json.loads((folder / "generation_config.json").read_text())
    assert written == {"bos_token_id": 1, "eos_token_id": 2, **SAMPLING_DEFAULTS, "do_sample": True}
    assert load_generation_defaults(folder) == SAMPLING_DEFAULTS
    assert SAMPLING_DEFAULTS["temperature"] < 1.0  # the point: this small model rambles at 1.0


def test_a_folder_without_generation_config_gets_one(tmp_path):
    folder = tmp_path / DEMO_MODEL_NAME
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    ensure_demo_model(tmp_path)
    assert json.loads((folder / "generation_config.json").read_text()) == {
        **SAMPLING_DEFAULTS,
        "do_sample": True,
    }
