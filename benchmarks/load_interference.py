"""Which part of loading an adapter slows a running decode batch (a diagnostic for issue 3).

    python3 benchmarks/load_interference.py          # on a CUDA machine
    python3 benchmarks/load_interference.py --smoke  # anywhere: tiny shapes on the CPU

The same decode batch as `adapter_loading.py` (a Llama-3.2-1B-shaped model with a few layers, 48
running requests over 8 adapters) steps while one background thread repeats one piece of the adapter
manager's loading work without pause, a piece per condition:
- `read`: `load_peft_adapter` (safetensors read, validation, float32 tensors)
- `image`: `LoRAPool.image` of an adapter already read (pinned when CUDA is present)
- `image-unpinned`: the same into pageable memory
- `read+image`: both, what a manager worker does per adapter
- `python`: a pure-Python loop, the GIL pressure of any busy thread
- `read-in-process`: `read` in a spawned process whose result comes back as shared-memory tensors, then
  `image` on the thread
- `image-in-process`: `read+image` in a spawned process into two shared-memory tensors; the thread only
  copies them into pinned memory
Prints the median and p99 step time per condition beside the quiet batch.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapter_loading import LLAMA_1B, RANK, SMOKE_MODEL, make_model_dir, write_peft_folder  # noqa: E402

from adapter_format.checkpoint import load_peft_adapter  # noqa: E402
from adapter_format.model_shape import ModelShape  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def _read_tensors(folder: str, shape: ModelShape) -> dict:
    """In a child process: read and validate, return the weights (torch shares them through shared memory)."""
    adapter = load_peft_adapter(folder, shape, RANK)
    return {key: (m.rank, m.scale, m.lora_a, m.lora_b) for key, m in adapter.modules.items()}


def _read_image(folder: str, shape: ModelShape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """In a child process: the whole load, into the slot image's two tensors."""
    from engine.lora.slots import SlotLayout, build_image

    image = build_image(SlotLayout(shape, RANK), dtype, load_peft_adapter(folder, shape, RANK))
    return image.weights, image.table


def background_work(kind: str, engine: LLMEngine, folders: list[Path], shape: ModelShape, pool):
    slots, pinned = engine.lora.slots, engine.lora.slots.device.type == "cuda"
    cycle = itertools.cycle(str(f) for f in folders)
    adapter = load_peft_adapter(folders[0], shape, RANK)
    if kind == "read":
        return lambda: load_peft_adapter(next(cycle), shape, RANK)
    if kind == "image":
        return lambda: slots.image(adapter, pin_memory=pinned)
    if kind == "image-unpinned":
        return lambda: slots.image(adapter, pin_memory=False)
    if kind == "read+image":
        return lambda: slots.image(load_peft_adapter(next(cycle), shape, RANK), pin_memory=pinned)
    if kind == "python":
        return lambda: sum(i * i for i in range(20000))
    if kind == "read-in-process":
        from adapter_format.checkpoint import ModuleLoRA, PeftAdapter

        def work():
            modules = pool.submit(_read_tensors, next(cycle), shape).result()
            modules = {key: ModuleLoRA(r, s, a, b) for key, (r, s, a, b) in modules.items()}
            slots.image(
                PeftAdapter(adapter.rank, adapter.alpha, adapter.target_modules, None, modules), pinned
            )

        return work
    if kind == "image-in-process":

        def work():
            weights, table = pool.submit(_read_image, next(cycle), shape, slots.dtype).result()
            torch.empty_like(weights, pin_memory=pinned).copy_(weights)
            torch.empty_like(table, pin_memory=pinned).copy_(table)

        return work
    raise ValueError(kind)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument(
        "--conditions", default="quiet,read,image,read+image,read-in-process,image-in-process,quiet"
    )
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    sizes = SMOKE_MODEL if args.smoke else LLAMA_1B
    batch, steps = (4, 5) if args.smoke else (args.batch, args.steps)
    with tempfile.TemporaryDirectory(prefix="interference-") as tmp:
        root = Path(tmp)
        model_dir = make_model_dir(root, sizes, 2 if args.smoke else args.layers, device)
        from transformers import AutoConfig

        shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
        folders = [write_peft_folder(root / f"ad-{i}", shape, seed=i) for i in range(8)]
        conditions = args.conditions.split(",")
        max_tokens = (len(conditions) + 1) * steps + 32
        config = EngineConfig(
            model=str(model_dir),
            max_num_seqs=batch,
            max_num_batched_tokens=2048,
            max_model_len=128 + max_tokens + 16,
            block_size=16,
            num_kv_blocks=(batch + 4) * (-(-(128 + max_tokens) // 16)),
            enable_prefix_caching=False,
            max_loras=8,
            max_cpu_loras=8,
            max_lora_rank=RANK,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            device=str(device),
        )
        engine = LLMEngine(config, skip_tokenizer_init=True)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        gen = torch.Generator().manual_seed(0)
        for i in range(batch):
            prompt = torch.randint(3, sizes["vocab_size"], (128,), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, params, str(folders[i % len(folders)].resolve()))
        while not (
            engine.scheduler.num_running == batch
            and all(r.num_output_tokens for r in engine.scheduler.running)
        ):
            engine.step()
        for _ in range(20):
            engine.step()
        context = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            pool.submit(_read_tensors, str(folders[0]), shape).result()  # start the child before timing
            print(
                f"\n{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}; {steps} steps each\n"
            )
            print("| background | median step ms | p99 step ms | background runs |\n|---|---|---|---|")
            for kind in conditions:
                stop, runs = threading.Event(), [0]
                if kind != "quiet":
                    work = background_work(kind, engine, folders, shape, pool)

                    def loop(work=work, stop=stop, runs=runs):
                        while not stop.is_set():
                            work()
                            runs[0] += 1

                    thread = threading.Thread(target=loop, daemon=True)
                    thread.start()
                    time.sleep(0.2)
                times = []
                for _ in range(steps):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    started = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - started)
                stop.set()
                if kind != "quiet":
                    thread.join()
                times.sort()
                p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
                print(f"| {kind} | {1e3 * statistics.median(times):.2f} | {1e3 * p99:.2f} | {runs[0]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
