"""The adapter residency record: every legal transition of the table, illegal ones refused, and the
statuses the manager moves an adapter through (load, stage, pin, evict, fail, delete)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from factories import make_adapter, make_model
from transformers import AutoConfig

from adapter_format.errors import AdapterError
from adapter_format.model_shape import ModelShape
from engine.lora.manager import AdapterManager
from engine.lora.pool import LoRAPool
from engine.lora.registry import AdapterRegistry
from engine.lora.residency import TRANSITIONS, AdapterStatus, IllegalTransition, ResidencyRecord

S = AdapterStatus
LEGAL = [(a, b) for a, targets in TRANSITIONS.items() for b in sorted(targets, key=lambda s: s.value)]
ILLEGAL = [(a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a]]


def test_the_table_names_every_status_and_deleted_is_final():
    assert set(TRANSITIONS) == set(S)
    assert TRANSITIONS[S.DELETED] == frozenset()
    # every status may end deleted but PINNED (a running request still uses it)
    assert {a for a in S if S.DELETED in TRANSITIONS[a]} == set(S) - {S.PINNED, S.DELETED}
    assert TRANSITIONS[S.PINNED] == {S.RESIDENT}


@pytest.mark.parametrize(("start", "end"), LEGAL, ids=[f"{a.name}->{b.name}" for a, b in LEGAL])
def test_every_legal_transition_moves(start, end):
    record = ResidencyRecord("a", status=start)
    record.move(end)
    assert record.status is end


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (S.STORED, S.RESIDENT),  # never on the GPU without a load and a copy
        (S.STORED, S.CPU),
        (S.LOADING, S.COPYING),  # a half-written row is never copied
        (S.CPU, S.PINNED),  # a request pins only a copied slot
        (S.COPYING, S.PINNED),
        (S.PINNED, S.CPU),  # a running request's slot is never evicted
        (S.PINNED, S.DELETED),
        (S.FAILED, S.LOADING),  # a failure expires to STORED first
        (S.DELETED, S.STORED),  # deleted ids are never served again
        (S.DELETED, S.LOADING),
    ],
)
def test_illegal_transitions_are_refused_and_leave_the_status(start, end):
    assert (start, end) in ILLEGAL
    record = ResidencyRecord("a", status=start)
    with pytest.raises(IllegalTransition, match=f"{start.name} -> {end.name}"):
        record.move(end)
    assert record.status is start


@pytest.mark.parametrize(("start", "end"), ILLEGAL, ids=[f"{a.name}->{b.name}" for a, b in ILLEGAL])
def test_every_pair_outside_the_table_is_refused(start, end):
    with pytest.raises(IllegalTransition):
        ResidencyRecord("a", status=start).move(end)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("residency")
    model_dir = make_model(root / "model", seed=3)
    good = make_adapter(model_dir, root / "good", seed=1, r=8, target_modules=["q_proj", "v_proj"])
    other = make_adapter(model_dir, root / "other", seed=2, r=4, target_modules=["o_proj"])
    return model_dir, good, other


def _manager(folders, max_loras=1, max_cpu_loras=1, registry_cls=AdapterRegistry):
    model_dir, good, other = folders
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    slots = LoRAPool(shape, max_loras=max_loras, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    registry = registry_cls(shape, 16)
    registry.register("good", good)
    registry.register("other", other)
    return AdapterManager(registry, slots, max_cpu_loras=max_cpu_loras)


def _settle(manager, adapter_id):
    deadline = time.monotonic() + 10
    while manager.status(adapter_id) is S.LOADING:
        assert time.monotonic() < deadline
        manager.wait_for_loads(0.1)
        manager.poll()


def test_the_manager_moves_an_adapter_through_its_statuses(folders):
    manager = _manager(folders)
    assert manager.status("good") is None
    manager.hold("good")
    assert manager.status("good") is S.STORED
    manager.prefetch("good")
    assert manager.status("good") is S.LOADING
    _settle(manager, "good")
    assert manager.status("good") is S.CPU and manager.cpu_ids() == ("good",)
    manager.stage(["good"])  # on the CPU the copy is synchronous: COPYING until is_ready looks
    assert manager.is_ready("good") and manager.status("good") is S.RESIDENT
    manager.acquire("good")
    manager.acquire("good")
    assert manager.status("good") is S.PINNED
    manager.release("good")
    assert manager.status("good") is S.PINNED  # one running request is left
    manager.release("good")
    assert manager.status("good") is S.RESIDENT
    # "other" needs the only row and the only slot: "good" keeps its slot but loses its CPU copy
    manager.hold("other")
    manager.prefetch("other")
    _settle(manager, "other")
    assert manager.status("good") is S.RESIDENT and manager.cpu_ids() == ("other",)
    manager.stage(["other"])
    assert manager.is_ready("other")
    assert manager.status("good") is S.STORED and manager.gpu_ids() == ("other",)
    manager.unhold("good")
    assert manager.status("good") is None  # nothing local, nobody waiting: forgotten
    manager.forget("other")  # held: deleted, but dropped only when its request ends
    assert manager.status("other") is S.RESIDENT
    with pytest.raises(AdapterError, match="was deleted"):
        manager.resolve("other")
    manager.unhold("other")
    assert manager.status("other") is S.DELETED and manager.gpu_ids() == () and manager.cpu_ids() == ()
    manager.shutdown()


def test_a_failed_load_is_failed_until_it_expires(folders, tmp_path, monkeypatch):
    manager = _manager(folders)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    adapter_id = manager.resolve(str(broken))
    manager.hold(adapter_id)
    manager.prefetch(adapter_id)
    _settle(manager, adapter_id)
    assert manager.status(adapter_id) is S.FAILED and "not valid JSON" in manager.error(adapter_id)
    assert manager.cpu_ids() == ()  # its row went back to the tier
    monkeypatch.setattr("engine.lora.manager.FAILURE_TTL_S", 0.0)
    time.sleep(0.01)
    assert manager.error(adapter_id) is None and manager.status(adapter_id) is S.STORED
    manager.shutdown()


def test_an_adapter_dropped_while_loading_ends_deleted_once_its_load_ends(folders):
    gate = threading.Event()

    class Gated(AdapterRegistry):
        def load(self, adapter_id, read=None):
            assert gate.wait(10)
            return super().load(adapter_id, read)

    manager = _manager(folders, registry_cls=Gated)
    manager.prefetch("good")
    manager.forget("good")
    assert manager.status("good") is S.LOADING  # its row is still being written
    gate.set()
    _settle(manager, "good")
    assert manager.status("good") is S.DELETED and manager.cpu_ids() == ()
    manager.shutdown()


def test_stage_retries_an_expired_failure_of_an_adapter_nobody_holds(folders, tmp_path, monkeypatch):
    """The expired failure forgets the record (nobody holds it); the retry `stage` starts must belong to
    a record the manager still knows, so that `poll` can collect it."""
    manager = _manager(folders)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("[]")
    adapter_id = manager.resolve(str(broken))
    manager.prefetch(adapter_id)
    _settle(manager, adapter_id)
    assert manager.status(adapter_id) is S.FAILED
    monkeypatch.setattr("engine.lora.manager.FAILURE_TTL_S", 0.0)
    time.sleep(0.01)
    manager.stage([adapter_id])
    assert manager.status(adapter_id) is S.LOADING
    _settle(manager, adapter_id)
    assert manager.status(adapter_id) is S.FAILED
    manager.shutdown()
