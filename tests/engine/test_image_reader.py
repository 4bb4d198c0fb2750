"""Reading adapter folders into rows of the CPU tier in loader processes: the same bytes as reading in
the calling thread, errors that keep their code and message across the process boundary, and a loader
process that dies failing only the read it was doing."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from factories import make_adapter, make_model
from safetensors import safe_open
from transformers import AutoConfig

from engine import AdapterError, EngineConfig, ModelShape
from engine.lora.host_tier import HostTier
from engine.lora.image_reader import ProcessImageReader, ThreadImageReader
from engine.lora.slots import SlotLayout

MAX_RANK = 16


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-reader")
    model_dir = make_model(root / "model", seed=3)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    adapter = make_adapter(
        model_dir, root / "adapter", seed=11, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    too_large = make_adapter(model_dir, root / "too-large", seed=12, r=32, lora_alpha=32, target_modules=["o_proj"])
    corrupt = root / "corrupt"
    shutil.copytree(adapter, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    return dict(model_dir=model_dir, layout=SlotLayout(shape, MAX_RANK), adapter=adapter, too_large=too_large,
                corrupt=corrupt)  # fmt: skip


def shared_tier(case, capacity: int = 3) -> HostTier:
    return HostTier(case["layout"], torch.float32, capacity, shared=True, pinned=False)


@pytest.fixture(scope="module")
def reader(case):
    reader = ProcessImageReader(shared_tier(case))
    yield reader
    reader.close()


def test_a_process_read_is_the_thread_read(case, reader):
    tier = reader.tier
    tier.weights.fill_(float("nan"))  # poisoned: every byte of the row must be written
    tier.table.fill_(-1)
    reader.read(case["adapter"], 1)
    image = tier.image(1)
    local = HostTier(case["layout"], torch.float32, 1, shared=False, pinned=False)
    ThreadImageReader(local).read(case["adapter"], 0)
    assert torch.equal(image.weights, local.weights[0]) and torch.equal(image.table, local.table[0])
    assert tier.weights[0].isnan().all() and tier.weights[2].isnan().all()  # other rows untouched
    # Against the file itself, not only against the other reader.
    scale = json.loads((case["adapter"] / "adapter_config.json").read_text())["lora_alpha"] / 8
    with safe_open(str(case["adapter"] / "adapter_model.safetensors"), framework="pt") as f:
        stored_a = f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight")
        stored_b = f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
    assert torch.equal(image.lora_a["down_proj"][1, :8], stored_a)
    assert torch.equal(image.lora_b["down_proj"][1, :, :8], stored_b)
    assert not image.lora_a["down_proj"][1, 8:].any() and not image.lora_a["o_proj"].any()
    assert image.scales["down_proj"][1].item() == scale and image.ranks["down_proj"][1].item() == 8
    assert image.ranks["o_proj"][1].item() == 0


@pytest.mark.parametrize(
    "folder, code, message",
    [
        ("too_large", "rank_too_large", "exceeds max_lora_rank 16"),
        ("corrupt", "bad_weights", "not a readable safetensors file"),
        ("missing", "not_found", "does not exist"),
    ],
)
def test_errors_cross_the_process_boundary_intact(case, reader, folder, code, message):
    path = case.get(folder, case["adapter"].parent / "no-such-adapter")
    with pytest.raises(AdapterError, match=message) as err:
        reader.read(path, 0)
    assert err.value.code == code


def test_a_dead_loader_process_fails_one_read_and_is_replaced(case):
    reader = ProcessImageReader(shared_tier(case), num_processes=1)
    try:
        reader.read(case["adapter"], 0)  # the process is up
        for process in reader.processes:
            process.kill()
            process.join()
        with pytest.raises(AdapterError, match="loader process died") as err:
            reader.read(case["adapter"], 1)
        assert err.value.code == "load_failed"
        reader.read(case["adapter"], 2)  # a new process serves the next load
        assert reader.tier.image(2).ranks["q_proj"].tolist() == [8] * case["layout"].shape.num_layers
    finally:
        reader.close()


def test_concurrent_reads_share_the_processes_without_helper_threads(case):
    """Four threads read at once through two processes: every row gets its adapter, and the serving
    process gains no threads of the reader's (each wake-up of one takes the GIL from the engine)."""
    threads_before = threading.active_count()
    reader = ProcessImageReader(shared_tier(case, capacity=4), num_processes=2)
    try:
        reader.tier.weights.fill_(float("nan"))
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda row: reader.read(case["adapter"], row), range(4)))
            assert threading.active_count() == threads_before + 4  # the pool's own, nothing more
        assert not reader.tier.weights.isnan().any()
        assert all(torch.equal(reader.tier.weights[row], reader.tier.weights[0]) for row in range(1, 4))
    finally:
        reader.close()


def test_a_closed_reader_refuses_reads_and_its_processes_exit(case):
    reader = ProcessImageReader(shared_tier(case), num_processes=1)
    reader.read(case["adapter"], 0)
    reader.close()
    with pytest.raises(AdapterError, match="shut down"):
        reader.read(case["adapter"], 1)
    for process in reader.processes:
        process.join(timeout=30)
        assert process.exitcode == 0


def test_the_config_picks_the_reader():
    assert not EngineConfig(model="m", device="cpu").loads_in_processes  # auto: threads on the CPU
    assert EngineConfig(model="m", device="cuda").loads_in_processes  # auto: processes on CUDA
    assert EngineConfig(model="m", device="cpu", adapter_loader="process").loads_in_processes
    assert not EngineConfig(model="m", device="cuda", adapter_loader="thread").loads_in_processes
    with pytest.raises(ValueError, match="adapter_loader must be one of auto, thread, process"):
        EngineConfig(model="m", adapter_loader="fork")


def test_loader_processes_need_a_shared_tier(case):
    with pytest.raises(ValueError, match="shared memory"):
        ProcessImageReader(HostTier(case["layout"], torch.float32, 1, shared=False, pinned=False))


def test_a_tier_larger_than_shared_memory_fails_at_start_with_the_remedy(case, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(64 << 20, 64 << 20, 0))
    with pytest.raises(RuntimeError, match=r"needs \d+ MiB of shared memory, but /dev/shm has 0 MiB free"):
        HostTier(case["layout"], torch.float32, 1, shared=True, pinned=False)
    HostTier(case["layout"], torch.float32, 1, shared=False, pinned=False)  # private memory: not checked


def test_alpha_and_rank_patterns_scale_each_module_as_peft_does(case, tmp_path):
    """`alpha_pattern` goes through PEFT's own key matching (imported only for it); the scales in the
    image must equal the `scaling` PEFT's LoRA layers use."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = make_adapter(
        case["model_dir"], tmp_path / "patterns", seed=13, r=8, lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        alpha_pattern={"q_proj": 64, "model.layers.1.mlp.down_proj": 4}, rank_pattern={"v_proj": 4},
    )  # fmt: skip
    tier = HostTier(case["layout"], torch.float32, 1, shared=False, pinned=False)
    ThreadImageReader(tier).read(folder, 0)
    image = tier.image(0)
    base = AutoModelForCausalLM.from_pretrained(case["model_dir"], dtype=torch.float32)
    peft_layers = PeftModel.from_pretrained(base, folder).base_model.model.model.layers
    for layer, modules in enumerate(peft_layers):
        for module, peft_module in (("q_proj", modules.self_attn.q_proj), ("v_proj", modules.self_attn.v_proj),
                                    ("down_proj", modules.mlp.down_proj)):  # fmt: skip
            assert image.scales[module][layer].item() == pytest.approx(peft_module.scaling["default"]), (layer, module)
            assert image.ranks[module][layer].item() == peft_module.r["default"]
    assert image.scales["down_proj"][1].item() == pytest.approx(4 / 8)  # the layer-specific pattern won
