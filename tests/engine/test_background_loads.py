"""Adapter loads in the background, whole in loader processes: the same bytes as a load on a thread, errors
that keep their code and message across the process boundary, a source's records sent back, queued jobs,
no thread per load in the serving process, and a loader process that dies failing only its own load."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch
from factories import make_adapter, make_model
from folder_sources import FolderSource, UnpicklableSource
from safetensors import safe_open
from transformers import AutoConfig

from engine import AdapterError, EngineConfig, ModelShape
from engine.lora.background_loads import ProcessLoads, ThreadLoads, read_into
from engine.lora.host_tier import HostTier
from engine.lora.slots import SlotLayout

MAX_RANK = 16


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("background-loads")
    model_dir = make_model(root / "model", seed=3)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    adapter = make_adapter(
        model_dir,
        root / "adapter",
        seed=11,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )
    too_large = make_adapter(
        model_dir, root / "too-large", seed=12, r=32, lora_alpha=32, target_modules=["o_proj"]
    )
    corrupt = root / "corrupt"
    shutil.copytree(adapter, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    return dict(
        root=root,
        model_dir=model_dir,
        layout=SlotLayout(shape, MAX_RANK),
        adapter=adapter,
        too_large=too_large,
        corrupt=corrupt,
    )


def shared_tier(case, capacity: int = 3) -> HostTier:
    return HostTier(case["layout"], torch.float32, capacity, shared=True, pinned=False)


def run(loads, jobs: dict[str, int], timeout: float = 120.0) -> dict[str, Exception | None]:
    """Start loads {adapter id: row} and collect them all, as the adapter manager does once per step."""
    for adapter_id, row in jobs.items():
        loads.start(adapter_id, row)
    done: dict[str, Exception | None] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(jobs):
        assert time.monotonic() < deadline, f"loads still running: {set(jobs) - set(done)}"
        loads.wait(0.5)
        done.update(loads.finished())
    return done


def collect(loads, adapter_id: str, timeout: float = 60.0) -> Exception | None:
    """Wait for one load already started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads.wait(0.5)
        done = dict(loads.finished())
        if adapter_id in done:
            return done[adapter_id]
    raise AssertionError(f"{adapter_id} never finished")


@pytest.fixture(scope="module")
def loads(case):
    loads = ProcessLoads(FolderSource(case["root"]), shared_tier(case))
    yield loads
    loads.close()


@pytest.mark.slow
def test_a_process_load_is_the_thread_load(case, loads):
    tier = loads.tier
    tier.weights.fill_(float("nan"))  # poisoned: every byte of the row must be written
    tier.table.fill_(-1)
    assert run(loads, {"adapter": 1}) == {"adapter": None}
    image = tier.image(1)
    local = HostTier(case["layout"], torch.float32, 1, shared=False, pinned=False)
    assert run(ThreadLoads(FolderSource(case["root"]), local), {"adapter": 0}) == {"adapter": None}
    assert torch.equal(image.weights, local.weights[0]) and torch.equal(image.table, local.table[0])
    assert tier.weights[0].isnan().all() and tier.weights[2].isnan().all()  # other rows untouched
    # Against the file itself, not only against the other loader.
    scale = json.loads((case["adapter"] / "adapter_config.json").read_text())["lora_alpha"] / 8
    with safe_open(str(case["adapter"] / "adapter_model.safetensors"), framework="pt") as f:
        stored_a = f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight")
        stored_b = f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
    assert torch.equal(image.lora_a["down_proj"][1, :8], stored_a)
    assert torch.equal(image.lora_b["down_proj"][1, :, :8], stored_b)
    assert not image.lora_a["down_proj"][1, 8:].any() and not image.lora_a["o_proj"].any()
    assert image.scales["down_proj"][1].item() == scale and image.ranks["down_proj"][1].item() == 8
    assert image.ranks["o_proj"][1].item() == 0


def test_the_source_runs_in_the_process_and_its_records_come_back(case, loads):
    source = loads.source
    source.replayed.clear()
    run(loads, {"adapter": 0})
    assert source.replayed == [("loaded", "adapter")]  # recorded by the process's copy, replayed here
    assert source.records == []  # this process's source never loaded anything


@pytest.mark.parametrize(
    "folder, code, message",
    [
        ("too-large", "rank_too_large", "is greater than max_lora_rank 16"),
        ("corrupt", "bad_weights", "not a valid safetensors file"),
        ("missing", "not_found", "does not exist"),
    ],
)
def test_errors_cross_the_process_boundary_intact(loads, folder, code, message):
    error = run(loads, {folder: 0})[folder]
    assert isinstance(error, AdapterError) and error.code == code
    assert message in str(error)


def test_a_source_that_cannot_be_pickled_fails_its_load_with_the_reason(case):
    loads = ProcessLoads(UnpicklableSource(case["root"]), shared_tier(case), num_processes=1)
    try:
        error = run(loads, {"adapter": 0})["adapter"]
        assert isinstance(error, AdapterError) and error.code == "load_failed"
        assert "cannot be sent to a loader process: holds a live connection" in str(error)
    finally:
        loads.close()


@pytest.mark.slow
def test_a_dead_loader_process_fails_one_load_and_is_replaced(case):
    loads = ProcessLoads(FolderSource(case["root"]), shared_tier(case), num_processes=1)
    try:
        assert run(loads, {"adapter": 0}) == {"adapter": None}  # the process is up
        loads.processes[0].kill()
        loads.processes[0].join()
        assert run(loads, {"adapter": 1}) == {"adapter": None}  # died idle: its replacement takes the job
        loads.start("hang", 2)
        time.sleep(0.5)
        loads.processes[0].kill()
        error = collect(loads, "hang")
        assert isinstance(error, AdapterError) and error.code == "load_failed"
        assert "loader process died while loading 'hang'" in str(error)
        assert run(loads, {"adapter": 2}) == {"adapter": None}  # a new process serves the next load
        assert loads.tier.image(2).ranks["q_proj"].tolist() == [8] * case["layout"].shape.num_layers
    finally:
        loads.close()


@pytest.mark.slow
def test_loads_beyond_the_processes_queue_and_the_serving_process_runs_no_thread_for_them(case):
    """Four loads through two processes: every row gets its adapter, and the serving process gains no
    thread (each wake-up of one would take the GIL from the engine thread)."""
    for i in range(4):
        shutil.copytree(case["adapter"], case["root"] / f"copy-{i}", dirs_exist_ok=True)
    threads_before = threading.active_count()
    loads = ProcessLoads(FolderSource(case["root"]), shared_tier(case, capacity=4), num_processes=2)
    try:
        loads.tier.weights.fill_(float("nan"))
        assert run(loads, {f"copy-{i}": i for i in range(4)}) == {f"copy-{i}": None for i in range(4)}
        assert threading.active_count() == threads_before
        assert not loads.tier.weights.isnan().any()
        assert all(torch.equal(loads.tier.weights[row], loads.tier.weights[0]) for row in range(1, 4))
    finally:
        loads.close()


@pytest.mark.slow
def test_a_loader_starts_its_next_job_before_the_engine_collects_the_last(case):
    """The engine collects answers once per step: a loader idle until then capped loads at one per loader
    per step. With two jobs sent, both rows are written while nobody calls `finished`."""
    loads = ProcessLoads(FolderSource(case["root"]), shared_tier(case), num_processes=1)
    try:
        loads.tier.weights.fill_(float("nan"))
        loads.start("adapter", 0)
        loads.start("adapter", 1)
        deadline = time.monotonic() + 60
        while loads.tier.weights[:2].isnan().any():
            assert time.monotonic() < deadline, "the second load never ran before its answer was collected"
            time.sleep(0.05)
        assert run(loads, {}) == {}  # nothing new started
        done = []
        while len(done) < 2 and time.monotonic() < deadline:
            done += loads.finished()
            time.sleep(0.01)
        assert done == [("adapter", None), ("adapter", None)]
    finally:
        loads.close()


@pytest.mark.slow
def test_jobs_waiting_behind_a_load_whose_process_dies_run_in_its_replacement(case):
    loads = ProcessLoads(FolderSource(case["root"]), shared_tier(case), num_processes=1)
    try:
        assert run(loads, {"adapter": 0}) == {"adapter": None}  # the process is up
        loads.start("hang", 1)
        loads.start("adapter", 2)  # sent into the same pipe, behind the load that hangs
        time.sleep(0.5)
        loads.processes[0].kill()
        error = collect(loads, "hang")
        assert isinstance(error, AdapterError) and "died while loading 'hang'" in str(error)
        assert collect(loads, "adapter") is None  # not failed: run again by the new process
        assert loads.tier.image(2).ranks["q_proj"].tolist() == [8] * case["layout"].shape.num_layers
    finally:
        loads.close()


@pytest.mark.slow
def test_closed_loads_refuse_new_ones_and_the_processes_exit(case):
    loads = ProcessLoads(FolderSource(case["root"]), shared_tier(case), num_processes=1)
    run(loads, {"adapter": 0})
    loads.close()
    error = run(loads, {"adapter": 1})["adapter"]
    assert isinstance(error, AdapterError) and "shut down" in str(error)
    for process in loads.processes:
        process.join(timeout=30)
        assert process.exitcode == 0


def test_the_config_picks_the_loader():
    assert not EngineConfig(model="m", device="cpu").loads_in_processes  # auto: threads on the CPU
    assert EngineConfig(model="m", device="cuda").loads_in_processes  # auto: processes on CUDA
    assert EngineConfig(model="m", device="cpu", adapter_loader="process").loads_in_processes
    assert not EngineConfig(model="m", device="cuda", adapter_loader="thread").loads_in_processes
    with pytest.raises(ValueError, match="adapter_loader must be one of auto, thread, process"):
        EngineConfig(model="m", adapter_loader="fork")


def test_loader_processes_need_a_shared_tier(case):
    with pytest.raises(ValueError, match="shared memory"):
        ProcessLoads(
            FolderSource(case["root"]), HostTier(case["layout"], torch.float32, 1, shared=False, pinned=False)
        )


def test_a_tier_larger_than_shared_memory_fails_at_start_with_the_remedy(case, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(64 << 20, 64 << 20, 0))
    with pytest.raises(RuntimeError, match=r"needs \d+ MiB of shared memory, but /dev/shm has 0 MiB free"):
        HostTier(case["layout"], torch.float32, 1, shared=True, pinned=False)
    HostTier(case["layout"], torch.float32, 1, shared=False, pinned=False)  # private memory: not checked


def test_alpha_and_rank_patterns_scale_each_module_as_peft_does(case, tmp_path):
    """`alpha_pattern` is matched by PEFT's rule (re-implemented with a time budget); the scales in the
    image must equal the `scaling` PEFT's LoRA layers use."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = make_adapter(
        case["model_dir"],
        tmp_path / "patterns",
        seed=13,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        alpha_pattern={"q_proj": 64, "model.layers.1.mlp.down_proj": 4, r"layers\.0\.self_attn\.v_.*": 2},
        rank_pattern={"v_proj": 4},
    )
    tier = HostTier(case["layout"], torch.float32, 1, shared=False, pinned=False)
    read_into(tier, 0, folder)
    image = tier.image(0)
    base = AutoModelForCausalLM.from_pretrained(case["model_dir"], dtype=torch.float32)
    peft_layers = PeftModel.from_pretrained(base, folder).base_model.model.model.layers
    for layer, modules in enumerate(peft_layers):
        for module, peft_module in (
            ("q_proj", modules.self_attn.q_proj),
            ("v_proj", modules.self_attn.v_proj),
            ("down_proj", modules.mlp.down_proj),
        ):
            assert image.scales[module][layer].item() == pytest.approx(peft_module.scaling["default"]), (
                layer,
                module,
            )
            assert image.ranks[module][layer].item() == peft_module.r["default"]
    assert image.scales["down_proj"][1].item() == pytest.approx(4 / 8)  # the layer-specific pattern won
    assert image.scales["v_proj"][0].item() == pytest.approx(2 / 4)  # a regex key, PEFT's way
