"""DoRA and saved LM heads against plain LoRA of the same rank: workload W1 (shape S, bf16, N=64 rank-16
adapters over every projection), once with plain LoRA adapters only and once with a quarter of them DoRA
and another quarter carrying their own lm_head (modules_to_save), in one invocation on the same model,
prompts and engine settings. Reports output tok/s and the steady decode step of each, and the mixed run's
step over the plain run's (the issue's target: within 1.25x).

    python3 benchmarks/adapter_formats.py                        # shape S, N=64, a quarter DoRA, a quarter lm_head
    python3 benchmarks/adapter_formats.py --lm-head-fraction 0   # DoRA only
    python3 benchmarks/adapter_formats.py --dora-fraction 0      # saved lm_heads only
    python3 benchmarks/adapter_formats.py --smoke                # tiny model on the CPU (checks that it runs)
    python3 benchmarks/adapter_formats.py --tensor-parallel-size 2   # both runs over 2 GPUs (vocab rows split)

The DoRA adapters are the plain ones plus use_dora and magnitude vectors (random, near the base rows'
norms); the lm_head ones are the plain ones plus a random [vocab, hidden] head under modules_to_save:
neither step cost depends on the values. The mixed run gets one vocab slot per lm_head adapter
(--max-vocab-loras; each takes 2 x vocab x hidden of GPU and host memory).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import throughput  # noqa: E402
from benchmarks import w1_setup as w1  # noqa: E402


def make_dora(plain: Path, dest: Path, seed: int) -> Path:
    """A DoRA copy of a plain W1 adapter: use_dora plus a magnitude per output row of each pair."""
    dest.mkdir(parents=True)
    config = json.loads((plain / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    tensors = load_file(plain / "adapter_model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith("lora_B.weight")]:
        out_features = tensors[name].shape[0]
        fan_in = tensors[name.replace("lora_B", "lora_A")].shape[1]
        norm = 0.02 * fan_in**0.5  # W1's weights: std 0.02
        magnitude = norm * (0.9 + 0.2 * torch.rand(out_features, generator=gen))
        tensors[name.replace("lora_B.weight", "lora_magnitude_vector")] = magnitude.to(tensors[name].dtype)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return dest


def make_saved_head(plain: Path, dest: Path, seed: int, vocab: int, hidden: int) -> Path:
    """A copy of a plain W1 adapter with its own lm_head (modules_to_save), std 0.02 as W1's weights."""
    dest.mkdir(parents=True)
    config = json.loads((plain / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    tensors = load_file(plain / "adapter_model.safetensors")
    dtype = next(iter(tensors.values())).dtype
    gen = torch.Generator().manual_seed(seed)
    head = 0.02 * torch.randn(vocab, hidden, generator=gen)
    tensors["base_model.model.lm_head.weight"] = head.to(dtype)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return dest


def steady_step_ms(result) -> float:
    steps = result.steady_decode()
    return 1e3 * statistics.median(s.seconds for s in steps) if steps else float("nan")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="S", choices=[s for s in w1.SHAPES if s != "smoke"])
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--dora-fraction", type=float, default=0.25)
    p.add_argument("--lm-head-fraction", type=float, default=0.25, help="adapters with a saved lm_head")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs of both runs (default 1)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few requests")
    args = p.parse_args(argv)
    args.device, args.dtype = "cuda", "bfloat16"
    args.min_prompt, args.max_prompt, args.max_num_seqs, args.max_num_batched_tokens = 128, 512, 128, 8192
    args.no_warmup_run, args.profile = False, False
    if args.smoke:
        args.shape, args.device, args.dtype, args.adapters = "smoke", "cpu", "float32", 4
        args.num_requests, args.min_prompt, args.max_prompt, args.output_tokens = 6, 8, 24, 4
        args.max_num_seqs, args.max_num_batched_tokens = 4, 64
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    return throughput.with_engine_defaults(args)


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = w1.llama_config(args.shape)
    prompts = w1.prompt_sets(
        random.Random(0), config.vocab_size, args.num_requests, args.min_prompt, args.max_prompt
    )
    max_len = args.max_prompt + args.output_tokens
    num_dora = round(args.adapters * args.dora_fraction)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = w1.make_model(root / "model", args.shape, dtype, device)
        plain = w1.make_adapters(root, model_dir, config, args.adapters, args.rank, dtype)
        # Every 1/fraction-th adapter DoRA, so round-robin requests mix the two in every step.
        stride = max(1, round(1 / args.dora_fraction)) if num_dora else 0
        dora_ids = set(range(0, stride * num_dora, stride)) if num_dora else set()
        # The lm_head ones half a stride further on: every step mixes plain, DoRA and lm_head adapters.
        num_head = round(args.adapters * args.lm_head_fraction)
        head_stride = max(1, round(1 / args.lm_head_fraction)) if num_head else 0
        free = [i for i in range(args.adapters) if i not in dora_ids]
        offset = head_stride // 2
        head_ids = (
            set(([i for i in free if (i - offset) % head_stride == 0] + free)[:num_head])
            if num_head
            else set()
        )
        mixed = [
            make_dora(path, root / f"dora{i}", seed=i)
            if i in dora_ids
            else make_saved_head(path, root / f"head{i}", i, config.vocab_size, config.hidden_size)
            if i in head_ids
            else path
            for i, path in enumerate(plain)
        ]
        mixed_name = f"{len(dora_ids)} DoRA {len(head_ids)} lm_head"
        runs = []
        for name, adapters, vocab_slots in (("plain LoRA", plain, 0), (mixed_name, mixed, len(head_ids))):
            args.max_vocab_loras = vocab_slots
            result, _ = throughput.run_engine(
                args, name, model_dir, adapters, prompts.measured, max_len, None, prompts.warm_up
            )
            runs.append(result)
    print(
        f"W1 shape {args.shape}, {args.dtype}, N={args.adapters} rank {args.rank}, {device}, "
        f"tensor_parallel_size {args.tensor_parallel_size}"
    )
    print(f"{'run':<22} {'output tok/s':>12} {'decode step ms':>15}  note")
    for r in runs:
        print(f"{r.name:<22} {r.tokens_per_second:>12.0f} {steady_step_ms(r):>15.2f}  {r.note}")
    ratio = steady_step_ms(runs[1]) / steady_step_ms(runs[0])
    print(f"summary: DoRA + lm_head mix decode step / plain LoRA = {ratio:.3f}x (target <= 1.25x)")


if __name__ == "__main__":
    main()
