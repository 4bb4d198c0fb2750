"""The store as the engine's adapter source: ids, errors that name the adapter, and whole requests through
LLMEngine (local store, and moto's S3 server) whose tokens match transformers + PEFT."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from factories import load_peft_reference, make_adapter, make_model, reference_greedy
from transformers import AutoConfig

from adapter_format.names import format_adapter_id, parse_adapter_id
from adapters_store import AdapterFiles, CountingMetrics, DiskCache, StoreConfig, StoreUnavailable, open_store
from adapters_store.engine_source import StoreAdapterSource
from engine import AdapterError, EngineConfig, LLMEngine, ModelShape, SamplingParams

NUM_NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
WEIGHTS = "adapter_model.safetensors"


@pytest.mark.parametrize(
    "adapter_id, parsed",
    [("acme/support-bot@3", ("acme", "support-bot", 3)), ("t_1/a.b@12", ("t_1", "a.b", 12))],
)
def test_adapter_ids_round_trip(adapter_id, parsed):
    assert parse_adapter_id(adapter_id) == parsed
    assert format_adapter_id(*parsed) == adapter_id


@pytest.mark.parametrize(
    "ref, message",
    [
        ("support-bot@3", "has no tenant"),
        ("acme/support-bot", "has no version"),
        ("acme/support-bot@0", "positive integer"),
        ("../etc/passwd@1", "tenant '..'"),
        ("acme/a/b@1", "path separator"),
        ("acme/a@1@2", "positive integer"),
        ("", "has no tenant"),
    ],
)
def test_bad_ids_are_unknown_adapters_without_any_io(ref, message):
    source = StoreAdapterSource(store=None, disk_cache=None, shape=None, max_lora_rank=16)  # no I/O possible
    with pytest.raises(AdapterError, match=message) as err:
        source.resolve(ref)
    assert err.value.code == "unknown_adapter" and repr(ref) in str(err.value)


def test_format_checks_names():
    with pytest.raises(ValueError, match="contains '@'"):
        format_adapter_id("acme", "a@1", 2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-source")
    model_dir = make_model(root / "model", seed=7)
    folders = {
        "a1": make_adapter(
            model_dir, root / "a1", seed=31, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        ),
        "a2": make_adapter(
            model_dir, root / "a2", seed=32, r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"]
        ),
        "b1": make_adapter(
            model_dir, root / "b1", seed=33, r=16, lora_alpha=16, target_modules=["k_proj", "up_proj"]
        ),
    }
    reference = load_peft_reference(model_dir, folders)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 16))] for _ in range(4)]
    expected = {
        (i, adapter): reference_greedy(reference, prompt, adapter, NUM_NEW_TOKENS)
        for i, prompt in enumerate(prompts)
        for adapter in [*folders, None]
    }
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    return dict(model_dir=model_dir, folders=folders, prompts=prompts, expected=expected, shape=shape)


def files(folder) -> AdapterFiles:
    return AdapterFiles(config=folder / "adapter_config.json", weights=folder / WEIGHTS)


def make_engine(setup, store, cache_dir, events: Counter | None = None, loader: str = "thread") -> LLMEngine:
    """`loader` "process": whole loads (manifest, disk cache, read) in loader processes, their observer
    events and store metrics sent back (engine/lora/background_loads.py), as on CUDA by default."""

    def observe(event, tier, seconds):
        if events is not None:
            events[(event, tier)] += 1

    cache = DiskCache(store, cache_dir, 1 << 30, CountingMetrics())
    # Room for every adapter in the CPU tier, so each is loaded from the source exactly once.
    config = EngineConfig(
        model=str(setup["model_dir"]),
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=16,
        block_size=8,
        max_model_len=64,
        dtype="float32",
        adapter_loader=loader,
    )
    return LLMEngine(
        config,
        skip_tokenizer_init=True,
        adapter_observer=observe,
        adapter_source_factory=lambda shape, rank: StoreAdapterSource(
            store, cache, shape, rank, observer=observe
        ),
    )


def run(engine: LLMEngine, prompts: list[list[int]], plan: list[tuple[int, str | None]]) -> list:
    """plan: (prompt index, adapter id) per request; returns the final outputs in plan order."""
    for n, (prompt_index, adapter) in enumerate(plan):
        engine.add_request(str(n), prompts[prompt_index], GREEDY, adapter)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[str(n)] for n in range(len(plan))]


@pytest.fixture
def local_store(setup, tmp_path):
    store = open_store(StoreConfig(url=f"file://{tmp_path / 'store'}"), setup["shape"], CountingMetrics())
    store.put("acme", "a", files(setup["folders"]["a1"]))
    store.put("acme", "a", files(setup["folders"]["a2"]))  # version 2
    store.put("acme", "b", files(setup["folders"]["b1"]))
    store.put("other", "a", files(setup["folders"]["b1"]))  # same name, another tenant, other weights
    return store


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["thread", "process"])
def test_store_adapters_end_to_end_match_peft(setup, local_store, tmp_path, loader):
    events = Counter()
    engine = make_engine(setup, local_store, tmp_path / "cache", events, loader)
    plan = [
        (0, "acme/a@1"),
        (1, "acme/a@2"),
        (2, "acme/b@1"),
        (3, None),
        (0, "other/a@1"),
        (1, "acme/a@9"),
        (2, "acme/nope@1"),
        (3, "acme/a@2"),
    ]
    served = {"acme/a@1": "a1", "acme/a@2": "a2", "acme/b@1": "b1", "other/a@1": "b1", None: None}
    outputs = run(engine, setup["prompts"], plan)
    for (prompt_index, adapter), output in zip(plan, outputs):
        if adapter in served:
            assert output.error is None, output.error
            assert output.outputs[0].token_ids == setup["expected"][(prompt_index, served[adapter])], adapter
    assert "'acme/a@9' does not exist" in outputs[5].error and "no version 9" in outputs[5].error
    assert "'acme/nope@1' does not exist" in outputs[6].error
    # Four adapters came from the store through the disk cache; nothing hit it yet.
    assert events[("miss", "disk")] == events[("load", "store")] == events[("load", "disk")] == 4
    assert events[("hit", "disk")] == 0 and events[("fail", "source")] == 2
    assert local_store.metrics.num_fetches == 4  # the store's own metrics, wherever the loads ran
    engine.shutdown()

    # A second engine (a restart) finds them in the disk cache: no downloads.
    events.clear()
    again = make_engine(setup, local_store, tmp_path / "cache", events, loader)
    outputs = run(again, setup["prompts"], [(2, "acme/b@1")])
    assert outputs[0].outputs[0].token_ids == setup["expected"][(2, "b1")]
    assert (events[("hit", "disk")], events[("miss", "disk")], events[("load", "store")]) == (1, 0, 0)
    again.shutdown()


def test_a_store_outage_fails_only_that_adapters_requests(setup, local_store, tmp_path, monkeypatch):
    """On loader threads: the patched store does not travel to loader processes (the S3 test below
    covers a store error in them)."""
    real_get = local_store.get

    def flaky_get(tenant, name, version=None):
        if name == "b":
            raise StoreUnavailable("read acme/b/1/manifest.json failed: connection reset", "connection reset")
        return real_get(tenant, name, version)

    monkeypatch.setattr(local_store, "get", flaky_get)
    engine = make_engine(setup, local_store, tmp_path / "cache")
    plan = [(0, "acme/b@1"), (1, "acme/a@1"), (2, "acme/b@1"), (3, None)]
    outputs = run(engine, setup["prompts"], plan)
    for index in (0, 2):
        assert "'acme/b@1' could not be fetched from the store: it is unavailable" in outputs[index].error
        assert "connection reset" not in outputs[index].error  # the log has it; clients get no internals
    assert outputs[1].outputs[0].token_ids == setup["expected"][(1, "a1")]
    assert outputs[3].outputs[0].token_ids == setup["expected"][(3, None)]


def test_an_adapter_on_local_disk_loads_while_the_store_is_down(setup, local_store, tmp_path, monkeypatch):
    """The disk cache keeps each version's manifest: a restarted engine (or one whose CPU tier dropped the
    adapter) loads it from disk without asking the store, so an S3 outage spares it."""
    first = make_engine(setup, local_store, tmp_path / "cache")
    assert run(first, setup["prompts"], [(0, "acme/b@1")])[0].error is None
    first.shutdown()

    def store_down(*args, **kwargs):
        raise StoreUnavailable("read acme/b/1/manifest.json failed: connection refused", "refused")

    monkeypatch.setattr(local_store, "get", store_down)
    events = Counter()
    again = make_engine(setup, local_store, tmp_path / "cache", events)
    outputs = run(again, setup["prompts"], [(0, "acme/b@1"), (1, "acme/a@1")])
    again.shutdown()
    assert outputs[0].outputs[0].token_ids == setup["expected"][(0, "b1")]
    assert events[("hit", "disk")] == 1
    assert (
        "'acme/a@1' could not be fetched from the store: it is unavailable" in outputs[1].error
    )  # not on disk


def test_cached_record_reads_the_cached_manifest_only(setup, local_store, tmp_path):
    cache = DiskCache(local_store, tmp_path / "cache", 1 << 30)
    record = local_store.get("acme", "a", 2)
    assert cache.cached_record("acme", "a", 2) is None
    with cache.checkout("acme", record):
        pass
    assert cache.cached_record("acme", "a", 2) == record
    assert cache.cached_record("acme", "a", 1) is None and cache.cached_record("other", "a", 2) is None
    cache.discard("acme", "a", 2)
    assert cache.cached_record("acme", "a", 2) is None


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["thread", "process"])
def test_through_s3_a_checksum_mismatch_is_that_requests_error(
    setup, s3_endpoint, s3_bucket, s3_admin, tmp_path, loader
):
    config = StoreConfig(url=f"s3://{s3_bucket}/p", endpoint_url=s3_endpoint, retries=0)
    store = open_store(config, setup["shape"], CountingMetrics())
    store.put("acme", "good", files(setup["folders"]["a2"]))
    store.put("acme", "bad", files(setup["folders"]["b1"]))
    key = f"p/acme/bad/1/{WEIGHTS}"
    body = bytearray(s3_admin.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF  # same size, other bytes: only the checksum can tell
    s3_admin.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    events = Counter()
    engine = make_engine(setup, store, tmp_path / "cache", events, loader)
    outputs = run(engine, setup["prompts"], [(0, "acme/bad@1"), (1, "acme/good@1"), (2, "acme/bad@1")])
    engine.shutdown()
    assert outputs[1].error is None
    assert outputs[1].outputs[0].token_ids == setup["expected"][(1, "a2")]
    for output in (outputs[0], outputs[2]):
        assert output.outputs[0].finish_reason == "error"
        assert "'acme/bad@1' could not be fetched from the store" in output.error
        assert "sha256" in output.error and "corrupt or was modified" in output.error
    assert events[("load", "store")] == 1 and events[("fail", "source")] == 1
