"""Adapter load rate (issue 19): loads per second into the CPU tier, through the server's own load path.

    python3 benchmarks/adapter_load_rate.py                    # shape S, rank 16, bf16 (about 22.5 MB each)
    python3 benchmarks/adapter_load_rate.py --loaders 2,4,8    # loader processes to compare
    python3 benchmarks/adapter_load_rate.py --smoke            # tiny shapes, a few names (checks it runs)
    python3 benchmarks/adapter_load_rate.py --cached 450 --disk-cache-gib 10   # W2's full disk cache

Runs on the CPU alone (no GPU is involved until a slot copy). A local adapter store holds `--names` adapter
names over `--sets` distinct weight sets (the other names hard links, as in W2). Each name is loaded once
the way `loraserve serve` loads it: `StoreAdapterSource` (manifest, disk cache, download) running whole in
`ProcessLoads`' loader processes (or `ThreadLoads` with `--loader thread`), writing into a shared
`HostTier` of `--rows` rows. A driver plays the engine: it starts a load whenever a row is free and
collects finished loads every `--poll-ms` (the engine collects once per step), so up to `--rows` loads are
queued at once, as when a deep waiting queue is prefetched.

Two passes per loader count: "store" (names not in the disk cache: every load downloads the store's files
into it, checks their sha256, then reads them) and "disk" (the same names again, all in the disk cache and
the page cache). `--cached N` first fills the disk cache with N other names, and `--disk-cache-gib` sets
its budget (the server's default is 10 GiB, about 450 such adapters), so that, as in W2, every insertion
of the store pass finds the cache full and evicts. Names share `--sets` weight files, and a linked
file's sha256 is computed once per loader process (adapters_store/link_digests.py): `--sets` equal to
`--names` measures distinct files, each hashed at its first fetch. Then a per-stage breakdown of one
load on the calling thread (median over the names): manifest, disk-cache checkout (with the download on
the store pass), config + header + shape checks, and the whole read into the tier's row.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapter_format.files import WEIGHTS_FILE  # noqa: E402
from adapter_format.model_shape import ModelShape  # noqa: E402
from adapter_format.names import parse_adapter_id  # noqa: E402
from adapters_store.cache import DiskCache  # noqa: E402
from adapters_store.config import StoreConfig  # noqa: E402
from adapters_store.engine_source import StoreAdapterSource  # noqa: E402
from adapters_store.local import LocalStore  # noqa: E402
from benchmarks.adapter_loading import SMOKE_SHAPE, write_peft_folder  # noqa: E402
from benchmarks.adapter_scale_setup import DEFAULT_TENANT, build_local_store  # noqa: E402
from engine.lora.background_loads import ProcessLoads, ThreadLoads, read_into  # noqa: E402
from engine.lora.host_tier import HostTier  # noqa: E402
from engine.lora.slots import SlotLayout  # noqa: E402

SHAPE_S = ModelShape(
    num_layers=16, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64
)
RANK = 16


def make_store(root: Path, shape: ModelShape, sets: int, names: int) -> list[str]:
    """A local store of `names` adapter names over `sets` weight sets; returns their engine ids."""
    folders = [write_peft_folder(root / "sets" / f"set{i}", shape, seed=i) for i in range(sets)]
    mapping = {(DEFAULT_TENANT, f"lr-{k:04d}"): k % sets for k in range(names)}
    build_local_store(root / "store", shape, RANK, folders, mapping)
    return [f"{tenant}/{name}@1" for tenant, name in mapping]


def fill_cache(cache: DiskCache, store: LocalStore, ids: list[str]) -> None:
    """Fetch `ids` into the disk cache (oldest first), as earlier traffic would have."""
    for adapter_id in ids:
        tenant, name, version = parse_adapter_id(adapter_id)
        cache.fetch_record(tenant, store.get(tenant, name, version))


def run_pass(loads, ids: list[str], rows: int, poll_s: float) -> float:
    """Load every id once, at most `rows` at a time; returns loads per second."""
    free, pending, failed = list(range(rows)), list(ids), []
    in_flight: dict[str, int] = {}
    started = time.perf_counter()
    while pending or in_flight:
        while pending and free:
            adapter_id = pending.pop()
            in_flight[adapter_id] = free.pop()
            loads.start(adapter_id, in_flight[adapter_id])
        if poll_s:
            time.sleep(poll_s)  # the engine's step: loads are collected once per step
        else:
            loads.wait(1.0)
        for adapter_id, error in loads.finished():
            free.append(in_flight.pop(adapter_id))
            if error is not None:
                failed.append((adapter_id, error))
    elapsed = time.perf_counter() - started
    if failed:
        raise RuntimeError(f"{len(failed)} loads failed, e.g. {failed[0]}")
    return len(ids) / elapsed


def stage_breakdown(source: StoreAdapterSource, tier: HostTier, ids: list[str]) -> dict[str, float]:
    """Median milliseconds of each stage of one load, run on this thread."""
    from adapter_format.checkpoint import check_adapter
    from adapter_format.peft_config import read_adapter_config
    from adapter_format.safetensors_header import read_tensor_shapes

    cache, shape = source.disk_cache, tier.layout.shape
    times: dict[str, list[float]] = {}

    @contextmanager
    def clock(stage: str):
        started = time.perf_counter()
        yield
        times.setdefault(stage, []).append(1000.0 * (time.perf_counter() - started))

    for adapter_id in ids:
        tenant, name, version = parse_adapter_id(adapter_id)
        with clock("manifest"):
            record = cache.cached_record(tenant, name, version) or source.store.get(tenant, name, version)
        checkout = cache.checkout(tenant, record)
        with clock("disk cache checkout (+ download)"):
            cached = checkout.__enter__()
        try:
            with clock("config + header + shape checks"):
                config = read_adapter_config(cached.path)
                shapes = read_tensor_shapes(cached.path / WEIGHTS_FILE)
                check_adapter(config, shapes, shape, tier.layout.max_rank)
            with clock("whole read_into (validate, read, lay out)"):
                read_into(tier, 0, cached.path)
        finally:
            checkout.__exit__(None, None, None)
    return {stage: statistics.median(samples) for stage, samples in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", type=int, default=256, help="adapter names loaded per pass")
    parser.add_argument("--sets", type=int, default=16, help="distinct weight sets behind the names")
    parser.add_argument("--loaders", default="2", help="comma-separated loader counts to compare")
    parser.add_argument("--loader", choices=("process", "thread"), default="process")
    parser.add_argument("--rows", type=int, default=128, help="CPU-tier rows (loads in flight at most)")
    parser.add_argument("--poll-ms", type=float, default=10.0, help="collect finished loads this often")
    parser.add_argument("--breakdown", type=int, default=16, help="loads timed stage by stage (0: none)")
    parser.add_argument(
        "--cached", type=int, default=0, help="other names in the disk cache before the passes"
    )
    parser.add_argument("--disk-cache-gib", type=float, default=1024.0, help="the disk cache's budget")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few names")
    args = parser.parse_args(argv)
    shape = SHAPE_S
    if args.smoke:
        shape, args.names, args.sets, args.rows, args.breakdown = SMOKE_SHAPE, 12, 3, 4, 4
    loader_counts = [int(n) for n in args.loaders.split(",")]
    root = Path(tempfile.mkdtemp(prefix="load-rate-"))
    try:
        everything = make_store(root, shape, args.sets, args.cached + args.names)
        filler, ids = everything[: args.cached], everything[args.cached :]
        cache_bytes = int(args.disk_cache_gib * 2**30)
        store_root = root / "store"
        store = LocalStore(store_root, StoreConfig(url=f"file://{store_root}", max_lora_rank=RANK), shape)
        layout = SlotLayout(shape, RANK)
        tier = HostTier(layout, torch.bfloat16, args.rows, shared=args.loader == "process", pinned=False)
        mb = layout.numel * 2 / 1e6
        print(
            f"adapter load rate: shape {'smoke' if args.smoke else 'S'}, rank {RANK}, bf16, {mb:.1f} MB "
            f"per image, {args.names} names over {args.sets} weight sets, {args.rows} tier rows, "
            f"collected every {args.poll_ms:g} ms; disk cache of {args.disk_cache_gib:g} GiB holding "
            f"{args.cached} other names; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}\n"
        )
        print(f"| {args.loader} loaders | pass | loads/s | MB/s |")
        print("|---:|---|---:|---:|")
        for count in loader_counts:
            cache_dir = root / f"cache-{count}"
            cache = DiskCache(store, cache_dir, cache_bytes)
            source = StoreAdapterSource(store, cache, shape, RANK)
            if args.loader == "process":
                loads = ProcessLoads(source, tier, num_processes=count)
            else:
                loads = ThreadLoads(source, tier, num_workers=count)
            try:
                run_pass(loads, ids[: min(len(ids), 2 * count)], args.rows, 0.0)  # imports, first calls
                shutil.rmtree(cache_dir)
                fill_cache(DiskCache(store, cache_dir, cache_bytes), store, filler)
                for label in ("store", "disk"):
                    rate = run_pass(loads, ids, args.rows, args.poll_ms / 1000.0)
                    print(f"| {count} | {label} -> CPU tier | {rate:.1f} | {rate * mb:.0f} |", flush=True)
            finally:
                loads.close()
        if args.breakdown:
            cache_dir = root / "cache-breakdown"
            source = StoreAdapterSource(store, DiskCache(store, cache_dir, 1 << 40), shape, RANK)
            torch.set_num_threads(1)  # as in a loader process
            picked = ids[: args.breakdown]
            for label in ("store", "disk"):
                print(f"\nstages of one load on this thread, {label} pass (median ms over {len(picked)}):\n")
                print("| stage | ms |")
                print("|---|---:|")
                for stage, value in stage_breakdown(source, tier, picked).items():
                    print(f"| {stage} | {value:.2f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
