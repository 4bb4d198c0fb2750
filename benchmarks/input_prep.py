"""Host time to prepare one decode step's inputs (InputBatch.update + prepare_decode), no model needed.

    python3 benchmarks/input_prep.py                    # CUDA if present (pinned buffers, real copies)
    python3 benchmarks/input_prep.py --device cpu --batch 128 --blocks 40

W1's steady state: `--batch` requests decoding together, each with a block table of about `--blocks`
blocks that grows by one block every `block_size` steps. Reports the median and p99 host time per step
(what the engine thread spends before the graph replay can start).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.input_batch import InputBatch  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ScheduledRequest  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--blocks", type=int, default=30, help="blocks per request at the start")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args(argv)
    device, bs, n = torch.device(args.device), args.block_size, args.batch
    max_blocks = args.blocks + args.steps // bs + 2
    batch = InputBatch(n, 8192, max_blocks, bs, n * max_blocks, device)
    requests = [Request(f"r{i}", [1] * (args.blocks * bs - 1), SamplingParams()) for i in range(n)]
    tables = [list(range(i * max_blocks, i * max_blocks + args.blocks)) for i in range(n)]
    for i, request in enumerate(requests):
        request.lora_slot = i % 64
    seconds = []
    for _ in range(args.steps):
        scheduled = []
        for request, table in zip(requests, tables):
            if request.num_tokens > len(table) * bs:
                table.append(table[-1] + 1)
            scheduled.append(ScheduledRequest(request, 1, request.num_tokens - 1, list(table)))
        started = time.perf_counter()
        batch.update(scheduled)
        batch.prepare_decode(scheduled, n)
        seconds.append(time.perf_counter() - started)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # as the engine's wait for the step's tokens would
        for request in requests:
            request.append_output_token(7)
    ordered = sorted(seconds[10:])
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    print(
        f"{args.device}: batch {n}, ~{args.blocks} blocks per request: update + prepare_decode "
        f"median {statistics.median(ordered) * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us per step"
    )


if __name__ == "__main__":
    main()
