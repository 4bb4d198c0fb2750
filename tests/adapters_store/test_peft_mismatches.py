"""Adapters PEFT would refuse, or would serve differently from the engine (tests/hostile_adapters.py's
PEFT_MISMATCHES): refused at upload with their code and config key, nothing stored, and refused again by the
engine's loaders (an adapter stored before these checks, or a local folder), with the same code."""

from __future__ import annotations

import pytest
from hostile_adapters import PEFT_MISMATCH_IDS, PEFT_MISMATCHES, write_peft_mismatch

from adapter_format.checkpoint import load_peft_adapter, map_peft_adapter
from adapter_format.errors import AdapterError
from adapters_store import InvalidAdapter


@pytest.fixture(params=["local"])
def backend(request):
    """Validation runs before any backend write: the local store is enough."""
    return request.param


@pytest.mark.parametrize(
    ("case_id", "changes", "edit", "code", "field"), PEFT_MISMATCHES, ids=PEFT_MISMATCH_IDS
)
def test_refused_at_upload_and_at_load(
    store, keys_of, adapter_dir, copy_adapter, model_shape, case_id, changes, edit, code, field
):
    folder = write_peft_mismatch(copy_adapter(adapter_dir), changes, edit)
    with pytest.raises(InvalidAdapter) as err:
        store.put("acme", "bad", folder)
    assert (err.value.code, err.value.field) == (code, field), err.value.message
    assert keys_of(store) == [], "nothing is written for a refused upload"
    assert len(err.value.message) < 600
    if field is not None:
        assert field.split("/")[0] in err.value.message
    if code == "bad_weight_values":
        assert "lora_" in err.value.message, "the message names the tensor"
    for load in (load_peft_adapter, map_peft_adapter):
        with pytest.raises(AdapterError) as loaded:
            load(folder, model_shape, 16)
        assert loaded.value.code == code


def test_the_unedited_adapter_is_accepted(store, adapter_dir, copy_adapter):
    """The control: the same folder without a case's edit stores fine, as do PEFT's spellings of the keys
    these checks read (CAUSAL_LM, every layer listed, the layer list's real name, a matching rank_pattern)."""
    folder = write_peft_mismatch(
        copy_adapter(adapter_dir),
        {
            "task_type": "CAUSAL_LM",
            "layers_to_transform": [0, 1],
            "layers_pattern": "layers",
            "rank_pattern": {"v_proj": 8},
            "exclude_modules": ["k_proj"],
            "layer_replication": None,
            "use_qalora": False,
        },
        None,
    )
    assert store.put("acme", "good", folder).rank == 8
