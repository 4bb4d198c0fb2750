"""What W2 and its cold-start mode share: weight sets, adapter stores of many names, request bodies, the
server's adapter metrics, and one row of results (benchmarks/adapter_scale.py, adapter_scale_cold.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import w1_setup as w1
from benchmarks.serve import percentile
from benchmarks.serve_client import Sample

DEFAULT_TENANT = "default"  # the tenant every request runs as when the server has no API keys


def make_weight_sets(root: Path, model_dir: Path, config, ranks: list[int], count: int, dtype) -> list[Path]:
    """`count` distinct PEFT folders over all seven projections; set i has rank ranks[i % len(ranks)]."""
    folders = []
    for rank in sorted(set(ranks)):
        indices = [i for i in range(count) if ranks[i % len(ranks)] == rank]
        made = w1.make_adapters(root / f"rank{rank}", model_dir, config, len(indices), rank, dtype)
        folders += list(zip(indices, made))
    return [folder for _, folder in sorted(folders)]


def build_local_store(
    store_root: Path, shape, max_lora_rank: int, sets: list[Path], names: dict[tuple[str, str], int]
) -> None:
    """A file store where each (tenant, name) holds version 1 of weight set `names[tenant, name]`: each set
    stored once per tenant with the store's `put`, every other name a version folder of hard links to
    those files and a manifest naming it (what `put` would write, minus the copies)."""
    from adapters_store.config import StoreConfig
    from adapters_store.filenames import MANIFEST_FILE
    from adapters_store.local import LocalStore

    store = LocalStore(
        store_root, StoreConfig(url=f"file://{store_root}", max_lora_rank=max_lora_rank), shape
    )
    committed = {}  # (tenant, set index) -> (its version folder, its record)
    for (tenant, name), index in names.items():
        if (tenant, index) not in committed:
            record = store.put(tenant, name, sets[index])
            committed[tenant, index] = (store_root / tenant / name / str(record.version), record)
            continue
        source, record = committed[tenant, index]
        folder = store_root / tenant / name / "1"
        folder.mkdir(parents=True)
        for file in source.iterdir():
            if file.name != MANIFEST_FILE:
                os.link(file, folder / file.name)
        (folder / MANIFEST_FILE).write_bytes(dataclasses.replace(record, name=name, version=1).to_json())


def build_s3_store(url: str, endpoint: str, shape, max_lora_rank: int, sets, names) -> None:
    """The same names in S3 (moto's server on loopback): S3 has no links, so each name is a full upload."""
    from adapters_store.config import StoreConfig
    from adapters_store.factory import open_store

    store = open_store(StoreConfig(url=url, endpoint_url=endpoint, max_lora_rank=max_lora_rank), shape)
    for (tenant, name), index in names.items():
        store.put(tenant, name, sets[index])


def write_api_keys(path: Path, tenants: list[str]) -> dict[str, str]:
    """A keys file with one admin key per tenant; returns {tenant: key}."""
    keys = {tenant: f"bench-{tenant}-key-0123456789" for tenant in tenants}
    path.write_text(json.dumps({key: {"tenant": t, "role": "admin"} for t, key in keys.items()}))
    return keys


def zipf_names(names: list[str], num_requests: int, alpha: float, rng: random.Random) -> list[str]:
    """Draws with P(names[k]) proportional to 1 / (k + 1) ** alpha."""
    weights = [1.0 / (k + 1) ** alpha for k in range(len(names))]
    return rng.choices(names, weights=weights, k=num_requests)


def bodies(
    models: list[str], prompts: list[list[int]], output_tokens: int, key: str | None = None
) -> list[dict]:
    """Streaming /v1/completions bodies, one per (model, prompt), exactly `output_tokens` each; with
    `key`, sent with that API key (benchmarks/serve_client.py reads "__headers__")."""
    made = []
    for model, prompt in zip(models, prompts):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if key is not None:
            body["__headers__"] = {"Authorization": f"Bearer {key}"}
        made.append(body)
    return made


def scrape(metrics_url: str) -> dict[tuple[str, str], float]:
    """{(sample name, tier): value} of the adapter counters and histograms (`tier` or `source_tier`)."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10.0).text
    values = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("loraserve_adapter_"):
            continue
        for sample in family.samples:
            tier = sample.labels.get("tier", sample.labels.get("source_tier"))
            if tier is not None and not sample.name.endswith(("_bucket", "_created")):
                values[sample.name, tier] = sample.value
            elif sample.name in KV_TIER_GAUGES:  # no tier label: what the KV tier holds now
                values[sample.name, "kv"] = sample.value
    return values


KV_BLOCKS = "loraserve_adapter_kv_cache_blocks"
KV_TIER_GAUGES = (KV_BLOCKS, "loraserve_adapter_kv_cache_adapters")


def residency(before: dict, after: dict, seconds: float) -> dict:
    """Hit rates per tier and loads per second, from two scrapes around a run."""

    def delta(name: str, tier: str) -> float:
        return after.get((name, tier), 0.0) - before.get((name, tier), 0.0)

    def rate(tier: str) -> float:
        hits = delta("loraserve_adapter_cache_hits_total", tier)
        total = hits + delta("loraserve_adapter_cache_misses_total", tier)
        return hits / total if total else float("nan")

    loads = "loraserve_adapter_load_seconds_count"
    return {
        "gpu_hit": rate("gpu"),
        "kv_hit": rate("kv"),  # NaN with the KV tier off (no lookups)
        "cpu_hit": rate("cpu"),
        "disk_hit": rate("disk"),
        "cpu_loads_s": delta(loads, "source") / seconds,
        # copies into GPU slots, from the CPU tier or from KV blocks
        "gpu_loads_s": (delta(loads, "cpu") + delta(loads, "kv")) / seconds,
        "kv_loads_s": delta(loads, "kv") / seconds,
        "gpu_evictions": delta("loraserve_adapter_evictions_total", "gpu"),
        "kv_evictions": delta("loraserve_adapter_evictions_total", "kv"),  # copies lost to requests or saves
        "kv_blocks": after.get((KV_BLOCKS, "kv"), 0.0),  # held at the end of the run
    }


def summarize(samples: list[Sample], start: float, end: float) -> dict:
    ok = [s for s in samples if not s.error]
    return {
        "tok_s": sum(s.num_tokens for s in ok) / (end - start),
        "ttft": [s.first - s.sent for s in ok],
        "tpot": [(s.last - s.first) / max(1, s.num_tokens - 1) for s in ok],
        "errors": [s.error for s in samples if s.error],
        "seconds": end - start,
    }


def ms(values: list[float], q: float) -> float:
    return 1e3 * percentile(values, q)


def hit_rate(value: float) -> str:
    """A hit rate, or "-" where no request reached that tier (every adapter was found before it)."""
    return "-" if math.isnan(value) else f"{value:.1%}"
