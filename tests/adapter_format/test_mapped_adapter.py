"""`map_peft_adapter`: the same adapter as `load_peft_adapter` (checks, ranks, scales, tensors and their
dtypes), as views of the mapped file that never write to it and outlive its name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import adapter_format.checkpoint as checkpoint
from adapter_format.checkpoint import load_peft_adapter, map_peft_adapter
from adapter_format.errors import AdapterError
from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapter_format.model_shape import ModelShape

SHAPE = ModelShape(
    num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16
)
MODULES = {"q_proj": "self_attn", "v_proj": "self_attn", "down_proj": "mlp"}


def write_adapter(folder, rank: int, dtypes: list[torch.dtype], seed: int = 0):
    """A PEFT folder whose tensors cycle through `dtypes` (a file may mix them)."""
    folder.mkdir()
    gen = torch.Generator().manual_seed(seed)
    tensors, kinds = {}, iter(dtypes * 100)
    for layer in range(SHAPE.num_layers):
        for module, block in MODULES.items():
            in_features, out_features = SHAPE.module_dims(module)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen).to(next(kinds))
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen).to(
                next(kinds)
            )
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(MODULES))
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "rank, dtypes",
    [
        (4, [torch.float32]),
        (8, [torch.bfloat16]),
        (16, [torch.float16, torch.float64]),
        (3, [torch.bfloat16, torch.float32, torch.float16]),
    ],
)
def test_a_mapped_adapter_is_the_loaded_one(tmp_path, rank, dtypes):
    folder = write_adapter(tmp_path / "a", rank, dtypes)
    loaded, mapped = load_peft_adapter(folder, SHAPE, 16), map_peft_adapter(folder, SHAPE, 16)
    assert (mapped.rank, mapped.alpha, mapped.target_modules) == (
        loaded.rank,
        loaded.alpha,
        loaded.target_modules,
    )
    assert mapped.modules.keys() == loaded.modules.keys()
    for key, module in loaded.modules.items():
        twin = mapped.modules[key]
        assert (twin.rank, twin.scale) == (module.rank, module.scale)
        for ours, theirs in ((twin.lora_a, module.lora_a), (twin.lora_b, module.lora_b)):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_writing_to_a_mapped_tensor_leaves_the_file_as_it_was(tmp_path):
    folder = write_adapter(tmp_path / "a", 4, [torch.float32])
    before = (folder / WEIGHTS_FILE).read_bytes()
    adapter = map_peft_adapter(folder, SHAPE, 16)
    for module in adapter.modules.values():
        module.lora_a.fill_(7.0)
    assert (folder / WEIGHTS_FILE).read_bytes() == before
    assert not any(m.lora_a.eq(7.0).all() for m in load_peft_adapter(folder, SHAPE, 16).modules.values())


def test_mapped_tensors_outlive_the_files_name(tmp_path):
    folder = write_adapter(tmp_path / "a", 4, [torch.bfloat16])
    expected = load_peft_adapter(folder, SHAPE, 16)
    adapter = map_peft_adapter(folder, SHAPE, 16)
    (folder / WEIGHTS_FILE).unlink()  # as an eviction removes a cached folder: the inode lives on
    for key, module in expected.modules.items():
        assert torch.equal(adapter.modules[key].lora_b, module.lora_b)


def test_a_file_cut_short_after_its_header_was_checked_is_refused(tmp_path, monkeypatch):
    folder = write_adapter(tmp_path / "a", 4, [torch.float32])
    real = checkpoint.read_tensor_spans

    def then_truncate(path, label=None):
        spans = real(path, label)
        with open(path, "r+b") as f:
            f.truncate(max(span.offset for span in spans.values()))
        return spans

    monkeypatch.setattr(checkpoint, "read_tensor_spans", then_truncate)
    with pytest.raises(AdapterError, match="not a readable safetensors file") as caught:
        map_peft_adapter(folder, SHAPE, 16)
    assert caught.value.code == "bad_weights"


def test_the_checks_run_before_anything_is_mapped(tmp_path):
    folder = write_adapter(tmp_path / "a", 32, [torch.float32])
    with pytest.raises(AdapterError, match="max_lora_rank 16") as caught:
        map_peft_adapter(folder, SHAPE, 16)
    assert caught.value.code == "rank_too_large"
