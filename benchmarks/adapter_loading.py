"""Adapter loading benchmark (issue 3): load latency per tier, and decode step time while adapters load.

    python3 benchmarks/adapter_loading.py            # on a CUDA machine; prints markdown tables
    python3 benchmarks/adapter_loading.py --smoke    # anywhere: tiny shapes on the CPU, a few repeats

Load latency: a rank-16 adapter over all seven projections of the Llama-3.1-8B shape (hidden 4096,
intermediate 14336, 32 layers, 32 heads, 8 KV heads), random bf16 weights in a real PEFT folder
(adapter_config.json + adapter_model.safetensors). Median of N after warm-up, per tier, exactly as the
adapter manager does it:
- disk: folder -> validated CPU tensors -> a row of the CPU tier (pinned on CUDA); page cache warm, and
  cold (the file's pages dropped with posix_fadvise before each load); read in the calling thread, and
  by a loader process writing into the tier's shared rows (the engine's default on CUDA).
- CPU tier -> GPU slot: the pinned image copied into a slot on a side stream (GPU time between CUDA
  events, and wall time from the first enqueue to completion). Target: under 20 ms.
- S3 on loopback: an in-process moto server (only where boto3 and moto import), through the store and a
  cold disk cache: manifest read, download, sha256, then the disk step.
Decode under loading: LLMEngine on a random Llama-3.2-1B-shaped model (fewer layers, bf16) decoding a
batch of running requests over a few adapters, which come (as in the server's default) from a local
adapter store through a warm disk cache, or with `--source folders` straight from PEFT folders; step wall
times with no loads; with the same request traffic as below but for adapters already resident (the
control: requests arrive and are aborted, nothing loads); while a stream of other adapters loads beside
it (requests for them queue behind a full batch, so their adapters go disk -> CPU -> GPU slot and are
then dropped for the next ones), loaded whole in loader processes (the engine's default on CUDA) and,
for comparison, on loader threads; the same with loader processes that only sleep (the cost of the
loads' plumbing, of requests waiting on loads and of the slot copies, without any reading); the same
with every adapter already in the CPU tier (only slot copies); and with no loads but a process spinning
beside (what any busy process costs the batch on the host). The conditions take turns in rounds, in a
shuffled order (the running requests' contexts grow every step); besides each condition's median step,
the table gives its step over the control's in the same round (median and quartiles across rounds, and a
bootstrap 95% interval of that median), which cancels the machine's drift between rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapter_format.model_shape import TARGET_MODULES, ModelShape  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.lora.background_loads import ProcessLoads, ThreadLoads, read_into  # noqa: E402
from engine.lora.host_tier import HostTier  # noqa: E402
from engine.lora.pool import LoRAPool  # noqa: E402
from engine.lora.registry import AdapterRegistry  # noqa: E402

RANK = 16
LLAMA_8B = ModelShape(
    num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128
)
SMOKE_SHAPE = ModelShape(
    num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
SMOKE_MODEL = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
)


def write_peft_folder(folder: Path, shape: ModelShape, seed: int, dtype=torch.bfloat16) -> Path:
    """A PEFT LoRA folder as save_pretrained writes it, random A and B of rank 16 on every projection."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module in TARGET_MODULES:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = shape.module_dims(module)
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, in_features, generator=gen) * 0.01).to(
                dtype
            )
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, RANK, generator=gen) * 0.01).to(
                dtype
            )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = dict(
        peft_type="LORA",
        r=RANK,
        lora_alpha=32,
        target_modules=list(TARGET_MODULES),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=None,
    )
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def drop_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, repeats: int, warmup: int, before=None) -> list[float]:
    """Wall seconds of `fn()` per repeat, after `warmup` untimed calls; `before()` runs untimed each time."""
    samples = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append(time.perf_counter() - started)
    return samples


def ms(samples: list[float], quantile: float | None = None) -> float:
    """The median (or the given quantile, nearest rank) in milliseconds."""
    if quantile is None:
        return 1000.0 * statistics.median(samples)
    ordered = sorted(samples)
    return 1000.0 * ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


def round_ratios(times: list[float], control: list[float], block: int) -> list[float]:
    """Per round, a block's median step over the control block's median in the same round (drift
    between rounds cancels out of each ratio)."""
    return [
        statistics.median(times[i : i + block]) / statistics.median(control[i : i + block])
        for i in range(0, len(times), block)
    ]


def paired_ratios(times: list[float], control: list[float], block: int) -> tuple[float, float, float]:
    """The median and quartiles across rounds of `round_ratios`."""
    ratios = round_ratios(times, control, block)
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    return q2, q1, q3


def median_ci(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median: a ratio whose interval holds 1.0 is a cost
    these rounds cannot tell from none."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


# -- load latency per tier ------------------------------------------------------------------------


def bench_tiers(
    shape: ModelShape, device: torch.device, repeats: int, warmup: int, root: Path
) -> tuple[float, list[tuple[str, str, list[float]]]]:
    """(adapter MB, rows of (tier, what, seconds per repeat; empty when skipped))."""
    cuda = device.type == "cuda"
    folder = write_peft_folder(root / "adapter", shape, seed=0)
    size_mb = (folder / "adapter_model.safetensors").stat().st_size / 1e6
    slots = LoRAPool(shape, max_loras=4, max_rank=RANK, dtype=torch.bfloat16, device=device)

    tier = HostTier(slots.layout, slots.dtype, 1, shared=False, pinned=cuda)
    registry = AdapterRegistry(shape, RANK)
    adapter_id = registry.resolve(str(folder))
    processes = ProcessLoads(registry, HostTier(slots.layout, slots.dtype, 1, shared=True, pinned=cuda))
    in_process = lambda: load_now(processes, adapter_id)  # noqa: E731
    in_process()  # the processes are up
    drop = dict(before=lambda: drop_page_cache(folder))
    rows = [
        (
            "disk (page cache)",
            "folder -> CPU tier row, calling thread",
            timed(lambda: read_into(tier, 0, folder), repeats, warmup),
        ),
        (
            "disk (page cache)",
            "same, by a loader process (job sent, answer polled)",
            timed(in_process, repeats, warmup),
        ),
        (
            "disk (cold)",
            "folder -> CPU tier row, pages dropped first, calling thread",
            timed(lambda: read_into(tier, 0, folder), repeats, warmup, **drop),
        ),
        ("disk (cold)", "same, by a loader process", timed(in_process, repeats, warmup, **drop)),
    ]
    processes.close()
    image = tier.image(0)
    pages = list(range(image.num_pages, 2 * image.num_pages))  # slot 1's pages, one run
    if cuda:
        stream = torch.cuda.Stream(device)
        gpu_times = []

        def to_slot():
            stream.wait_stream(torch.cuda.current_stream(device))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                slots.load(1, image, pages)
                end.record(stream)
            end.synchronize()
            gpu_times.append(start.elapsed_time(end) / 1000.0)

        wall = timed(to_slot, repeats, warmup)
        rows.append(
            ("CPU tier -> GPU slot", "pinned image -> slot, side stream (GPU time)", gpu_times[warmup:])
        )
        rows.append(("CPU tier -> GPU slot", "same, wall: first enqueue to completion", wall))
    else:
        rows.append(
            (
                "CPU tier -> slot",
                "image -> slot (CPU device: a plain copy)",
                timed(lambda: slots.load(1, image, pages), repeats, warmup),
            )
        )
    rows.extend(bench_s3(shape, folder, repeats, warmup, root))
    return size_mb, rows


def load_now(loads, adapter_id: str, row: int = 0) -> None:
    """One load into `row`, waited for (the engine collects answers once per step instead)."""
    loads.start(adapter_id, row)
    while not (done := loads.finished()):
        loads.wait(1.0)
    [(_, error)] = done
    if error is not None:
        raise error


def bench_s3(shape: ModelShape, folder: Path, repeats: int, warmup: int, root: Path) -> list[tuple]:
    try:
        import boto3  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        print(f"S3 tier skipped: {exc} (needs boto3 and moto[server])")
        return [("S3 loopback", f"skipped: {exc.name or exc} not installed", [])]
    import logging
    import socket

    from adapters_store import AdapterFiles, DiskCache, StoreConfig, open_store
    from adapters_store.engine_source import StoreAdapterSource

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for var, value in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(var, value)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per HTTP request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        store = open_store(
            StoreConfig(url="s3://bench/adapters", endpoint_url=endpoint, max_lora_rank=RANK), shape
        )
        files = AdapterFiles(
            config=folder / "adapter_config.json", weights=folder / "adapter_model.safetensors"
        )
        record = store.put("bench", "adapter", files)
        events: dict[str, list[float]] = {"store": [], "disk": []}
        caches = iter(range(1 << 30))

        def observe(event, tier, seconds):
            if event == "load" and tier in events:
                events[tier].append(seconds)

        def cold_load():
            cache = DiskCache(store, root / f"cache-{next(caches)}", 1 << 34)  # cold: every load downloads
            StoreAdapterSource(store, cache, shape, RANK, observer=observe).load(f"bench/{record.ref}")

        total = timed(cold_load, repeats, warmup)
        return [
            ("S3 loopback", "manifest + download + sha256 -> disk cache", events["store"][warmup:]),
            ("S3 loopback", "all of it -> validated CPU tensors", total),
        ]
    finally:
        server.stop()


# -- decode step time while adapters load -----------------------------------------------------------


def make_model_dir(root: Path, sizes: dict, num_layers: int, device: torch.device) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**sizes, num_hidden_layers=num_layers, max_position_embeddings=131072)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    path = root / "model"
    model.save_pretrained(path, safe_serialization=True)
    del model
    return path


def decode_model(args, device: torch.device, root: Path) -> tuple[dict, Path, ModelShape]:
    """The decode benchmark's model (sizes, saved folder, shape): Llama-3.2-1B-shaped, or tiny with --smoke."""
    from transformers import AutoConfig

    sizes = SMOKE_MODEL if args.smoke else LLAMA_1B
    model_dir = make_model_dir(root, sizes, args.decode_layers, device)
    return sizes, model_dir, ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))


def adapter_folders(root: Path, shape: ModelShape, name: str, seed: int, count: int) -> list[str]:
    """`count` fresh PEFT folders for `shape`; their absolute paths are the adapter ids."""
    return [
        str(write_peft_folder(root / f"{name}-{i}", shape, seed=seed + i).resolve()) for i in range(count)
    ]


def store_adapters(root: Path, shape: ModelShape, folders: dict[str, list[str]]):
    """The folders uploaded to a local adapter store with a disk cache in front, as the server runs by
    default: ({kind: adapter ids `bench/name@1`}, a factory of the engine's StoreAdapterSource). The disk
    cache is filled first, so a load reads the cached folder as the server does once it has seen one."""
    from adapter_format.names import format_adapter_id
    from adapters_store import AdapterFiles, DiskCache, StoreConfig, open_store
    from adapters_store.engine_source import StoreAdapterSource

    store = open_store(StoreConfig(url=f"file://{root / 'store'}", max_lora_rank=RANK), shape)
    cache = DiskCache(store, root / "disk-cache", 1 << 40)
    ids = {}
    for kind, paths in folders.items():
        ids[kind] = []
        for path in map(Path, paths):
            files = AdapterFiles(
                config=path / "adapter_config.json", weights=path / "adapter_model.safetensors"
            )
            record = store.put("bench", path.name, files)
            cache.fetch_record("bench", record)
            ids[kind].append(format_adapter_id("bench", record.name, record.version))
    return ids, lambda shape, rank: StoreAdapterSource(store, cache, shape, rank)


def decode_engine(
    args,
    device,
    model_dir,
    sizes,
    batch_ids,
    cpu_ids,
    max_tokens,
    max_cpu_loras,
    adapter_loader,
    observer,
    adapter_source_factory=None,
) -> LLMEngine:
    """An engine running `args.batch` greedy requests over `batch_ids` (each past its prefill, `max_tokens`
    long), with the adapters of `cpu_ids` waiting in its CPU tier; adapters from local folders, or from
    `adapter_source_factory`."""
    prompt_len = args.prompt_len
    config = EngineConfig(
        model=str(model_dir),
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, prompt_len * 4),
        max_model_len=prompt_len + max_tokens + 16,
        block_size=16,
        num_kv_blocks=(args.batch + 8) * -(-(prompt_len + max_tokens) // 16),
        enable_prefix_caching=False,
        max_loras=args.max_loras,
        max_cpu_loras=max_cpu_loras,
        max_lora_rank=RANK,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        device=str(device),
        adapter_loader=adapter_loader,
    )
    engine = LLMEngine(
        config,
        skip_tokenizer_init=True,
        adapter_observer=observer,
        adapter_source_factory=adapter_source_factory,
    )
    # Every adapter reaches the CPU tier first, so that all requests start together: a request whose
    # adapter arrived early would otherwise run ahead (by hundreds of tokens while the loader processes
    # start) and reach max_tokens before the run ends.
    for adapter_id in [*batch_ids, *cpu_ids]:
        engine.lora.prefetch(engine.lora.resolve(adapter_id))
    while engine.lora.num_loading:
        engine.lora.wait_for_loads(timeout=1.0)
        assert not engine.lora.poll(), "an adapter failed to load"
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(3, sizes["vocab_size"], (prompt_len,), generator=gen).tolist()
        engine.add_request(f"run{i}", prompt, params, batch_ids[i % len(batch_ids)])
    while not (
        engine.scheduler.num_running == args.batch
        and all(r.num_output_tokens > 0 for r in engine.scheduler.running)
    ):
        engine.step()
    lengths = [r.num_output_tokens for r in engine.scheduler.running]
    assert max(lengths) - min(lengths) < 8, (
        f"the batch started unevenly: {min(lengths)}-{max(lengths)} tokens"
    )
    return engine


class Background:
    """Requests for other adapters that queue behind the full batch, only so that their adapters load.

    Before each step: requests whose adapter has become ready are aborted, and new ones are added every
    `every` steps up to `in_flight` at once, cycling through `adapter_ids`. With `cold`, an adapter is
    retired once it was ready, so its next use reads it from disk again (not from the CPU tier).
    """

    def __init__(
        self, engine, adapter_ids: list[str], in_flight: int, every: int = 1, cold: bool = False, loads=None
    ):
        self.engine, self.in_flight, self.every, self.cold = engine, in_flight, every, cold
        self.default_loads = engine.lora.loads
        if loads is not None:  # this block's loads run in `loads` instead of the engine's own
            engine.lora.loads = loads
        self.cycle = itertools.cycle(adapter_ids)
        self.requests: dict[str, str] = {}  # request id -> adapter id
        self.steps = 0

    def before_step(self) -> None:
        lora = self.engine.lora
        for request_id, adapter_id in list(self.requests.items()):
            if lora.is_ready(adapter_id):
                self.engine.abort_request(request_id)
                del self.requests[request_id]
                if self.cold:
                    lora.retire(adapter_id)  # no holder left: its CPU image and slot are dropped now
        if self.steps % self.every == 0 and len(self.requests) < self.in_flight:
            request_id = f"bg{next(_request_ids)}"
            self.requests[request_id] = next(self.cycle)
            self.engine.add_request(
                request_id, [5, 6, 7], SamplingParams(max_tokens=1), self.requests[request_id]
            )
        self.steps += 1

    def stop(self) -> None:
        """Abort this block's requests and let its loads end where they started (not measured)."""
        self.engine.abort_request(list(self.requests))
        self.requests.clear()
        lora = self.engine.lora
        while lora.num_loading:
            lora.wait_for_loads(timeout=1.0)
            assert not lora.poll(), "a background adapter failed to load"
        lora.loads = self.default_loads


_request_ids = itertools.count()


class BusyBeside:
    """No loads: a spawned process spinning at the loaders' priority for the whole block, which shows what
    any busy process beside the engine costs the batch on this host (shared caches, clocks, cores)."""

    def __init__(self):
        self.process = multiprocessing.get_context("spawn").Process(target=spin, daemon=True)
        self.process.start()
        time.sleep(0.5)  # its imports done, spinning

    def before_step(self) -> None:
        pass

    def stop(self) -> None:
        self.process.kill()
        self.process.join()


def spin() -> None:
    os.nice(10)
    while True:
        pass


class SleepingSource:
    """Loads that take as long as a real one but read nothing (the row keeps whatever it held): what the
    loads' plumbing and the slot copies cost, without the reading."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def load(self, adapter_id: str, read) -> None:
        time.sleep(self.seconds)


def bench_decode(args, device: torch.device, root: Path) -> list[tuple]:
    """Rows of (condition, step seconds, adapters copied into slots, loads per step)."""
    sizes, model_dir, shape = decode_model(args, device, root)
    folders = dict(
        batch=adapter_folders(root, shape, "batch", 100, args.batch_adapters),
        disk=adapter_folders(root, shape, "disk", 200, args.background_adapters),
        cpu=adapter_folders(root, shape, "cpu", 300, args.background_adapters),
    )
    ids, source_factory = store_adapters(root, shape, folders) if args.source == "store" else (folders, None)
    batch_ids, disk_ids, cpu_ids = ids["batch"], ids["disk"], ids["cpu"]
    in_flight, every = args.concurrent_loads, args.load_every
    conditions = {
        "no loads": None,
        "request traffic only (adapters already resident)": lambda: Background(engine, batch_ids, in_flight),
        "slot copies beside (CPU tier -> GPU), stress": lambda: Background(engine, cpu_ids, in_flight),
        "disk loads beside, stress, loader processes": lambda: Background(
            engine, disk_ids, in_flight, cold=True
        ),
        "disk loads beside, stress, loader threads": lambda: Background(
            engine, disk_ids, in_flight, cold=True, loads=threads
        ),
        "loads that only sleep 30 ms, stress, loader processes": lambda: Background(
            engine, disk_ids, in_flight, cold=True, loads=sleeping
        ),
        "a busy process beside, no loads": BusyBeside,
        f"disk loads beside, one every {every} steps, loader processes": lambda: Background(
            engine, disk_ids, 1, every, cold=True
        ),
        f"disk loads beside, one every {every} steps, loader threads": lambda: Background(
            engine, disk_ids, 1, every, cold=True, loads=threads
        ),
    }
    if args.only:  # the first two stay: the paired ratios need the control
        conditions = {
            label: start
            for i, (label, start) in enumerate(conditions.items())
            if i < 2 or any(part in label for part in args.only)
        }
    block, settle = args.block_steps, args.settle_steps
    total_steps = args.rounds * len(conditions) * (block + settle)
    max_tokens = total_steps + args.warmup + 16
    events = Counter()
    engine = decode_engine(
        args,
        device,
        model_dir,
        sizes,
        batch_ids,
        cpu_ids,
        max_tokens,
        max_cpu_loras=len(batch_ids) + len(cpu_ids) + args.concurrent_loads + 2,
        adapter_loader="process",
        observer=lambda e, t, s: events.update([(e, t)]),
        adapter_source_factory=source_factory,
    )
    # The engine's own source and rows, loaded on worker threads, or by processes that only sleep.
    threads = ThreadLoads(engine.lora.source, engine.lora.tier)
    sleeping = (
        ProcessLoads(SleepingSource(0.03), engine.lora.tier) if "sleep" in " ".join(conditions) else None
    )
    for _ in range(args.warmup):
        engine.step()

    times: dict[str, list[float]] = {label: [] for label in conditions}
    copies: Counter[str] = Counter()
    # Rounds of short blocks, one per condition, so that drift in the machine's speed over the run hits
    # every condition alike; the first `settle` steps of a block (while its first loads are still on the
    # way) are not counted, and a block's loads end before the next block starts. The order within a
    # round is shuffled: the running requests grow a token per step, so their attention slows every step
    # a little, and a fixed order would bill the blocks that come later in each round for it.
    order, shuffle = list(conditions.items()), random.Random(0).shuffle
    for _ in range(args.rounds):
        shuffle(order)
        for label, start in order:
            background = start() if start is not None else None
            for i in range(settle + block):
                if background is not None:
                    background.before_step()
                if i == settle:
                    events.clear()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                engine.step()
                if i >= settle:
                    times[label].append(time.perf_counter() - started)
                assert engine.scheduler.num_running == args.batch, "the measured batch must stay the same"
            copies[label] += events[("load", "cpu")]
            if background is not None:
                background.stop()
    engine.shutdown()
    threads.close()
    if sleeping is not None:
        sleeping.close()
    return [(label, times[label], copies[label], copies[label] / len(times[label])) for label in conditions]


def add_decode_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The options `decode_model`, `decode_engine` and the rounds of blocks read."""
    parser.add_argument("--batch", type=int, default=48, help="running requests in the measured decode batch")
    parser.add_argument(
        "--batch-adapters", type=int, default=8, help="distinct adapters of the running batch"
    )
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--decode-layers", type=int, default=4, help="layers of the 1B-shaped decode model")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds of one block per decode condition")
    parser.add_argument("--block-steps", type=int, default=40, help="decode steps measured per block")
    parser.add_argument("--settle-steps", type=int, default=10, help="uncounted steps starting each block")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    add_decode_arguments(parser, rounds=10)
    parser.add_argument("--background-adapters", type=int, default=32, help="adapters cycled through loading")
    parser.add_argument(
        "--concurrent-loads", type=int, default=4, help="background adapters in flight at once"
    )
    parser.add_argument("--load-every", type=int, default=20, help="steps between loads, realistic condition")
    parser.add_argument("--decode-only", action="store_true", help="skip the per-tier load latencies")
    parser.add_argument(
        "--source",
        choices=("store", "folders"),
        default="store",
        help="decode: adapters from a local store through the disk cache (the server's default), "
        "or straight from PEFT folders",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="decode: run only the conditions whose name contains TEXT (repeatable), besides "
        "the no-loads and control conditions",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (seconds; Python's default is 0.005)",
    )
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.smoke:
        args.repeats, args.warmup, args.batch, args.batch_adapters = 3, 1, 8, 2
        args.background_adapters, args.max_loras, args.decode_layers = 6, 4, 2
        args.prompt_len, args.rounds, args.block_steps, args.settle_steps = 8, 2, 4, 2
        args.load_every, device = 2, torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        parser.error("no CUDA device: run on a GPU machine, or pass --smoke")
    torch.manual_seed(0)
    shape = SMOKE_SHAPE if args.smoke else LLAMA_8B
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or 'cpu'})"
    )
    with tempfile.TemporaryDirectory(prefix="adapter-bench-") as tmp:
        size_mb, tiers = (
            (0.0, [])
            if args.decode_only
            else bench_tiers(shape, device, args.repeats, args.warmup, Path(tmp))
        )
        decode = bench_decode(args, device, Path(tmp))
    print(f"\n- **Device**: {name}; torch {torch.__version__}, python {platform.python_version()}")
    print(
        f"- **Command**: `python3 {shlex.join(['benchmarks/adapter_loading.py', *(argv or sys.argv[1:])])}`"
    )
    print(
        f"- **Adapter**: rank {RANK}, all seven projections, {size_mb:.1f} MB bf16 safetensors, "
        f"shape {'tiny (smoke)' if args.smoke else 'Llama-3.1-8B'}; median of {args.repeats} after {args.warmup} "
        "warm-up\n"
    )
    print(f"- **GIL switch interval**: {sys.getswitchinterval() * 1e3:g} ms\n")
    print("| tier | what | median ms | p90 ms |\n|---|---|---|---|")
    for tier, what, samples in tiers:
        if not samples:
            print(f"| {tier} | {what} | - | - |")
        else:
            print(f"| {tier} | {what} | **{ms(samples):.2f}** | {ms(samples, 0.9):.2f} |")
    print(
        f"\n- **Decode**: {args.batch} running requests over {args.batch_adapters} adapters, "
        f"{'tiny' if args.smoke else 'Llama-3.2-1B'}-shaped model with {args.decode_layers} layers, "
        f"prompts of {args.prompt_len}; max_loras {args.max_loras}; {args.rounds} rounds of one block per "
        f"condition ({args.block_steps} steps counted after {args.settle_steps}); stress: "
        f"a new adapter requested every step, up to {args.concurrent_loads} loads in flight; adapters "
        f"{'from a local store through the disk cache' if args.source == 'store' else 'from PEFT folders'}\n"
    )
    quiet = statistics.median(decode[0][1])
    traffic_times = decode[1][1]
    print(
        "| condition | steps | median step ms | p99 step ms | vs no loads | vs control, by round: median [IQR] "
        "| 95% CI of that median | loads per step |\n|---|---|---|---|---|---|---|---|"
    )
    for label, times, _, per_step in decode:
        ratio = statistics.median(times) / quiet
        mid, q1, q3 = paired_ratios(times, traffic_times, args.block_steps)
        low, high = median_ci(round_ratios(times, traffic_times, args.block_steps))
        print(
            f"| {label} | {len(times)} | **{ms(times):.2f}** | {ms(times, 0.99):.2f} | {ratio:.3f} | "
            f"**{mid:.3f}** [{q1:.3f}, {q3:.3f}] | {low:.3f}-{high:.3f} | {per_step:.2f} |"
        )
    traffic = statistics.median(decode[1][1])
    for label, times, _, per_step in decode[2:]:
        if per_step:  # from the paired ratio: the medians of whole runs differ by the contexts' growth too
            extra = (
                (paired_ratios(times, traffic_times, args.block_steps)[0] - 1.0) * traffic / per_step * 1e3
            )
            print(f"- {label}: {extra:.3f} ms of step time per load, beyond the same request traffic")
    return 0


if __name__ == "__main__":
    sys.exit(main())
