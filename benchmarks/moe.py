"""Mixture-of-experts decode against its bytes floor, with LoRA on attention and on the routed experts.

A Qwen3-30B-A3B-shaped model with random weights made on the device (load_format="dummy"; 48 layers,
hidden 2048, 128 experts, top 8, expert intermediate 768, 32 heads, 4 KV heads), workload W1's requests
(prompts of uniform [128, 512] random tokens, exactly --output-tokens each, all at once, adapters round
robin), once per adapter count in --adapters (0 = no LoRA). Per run: output tokens/s, the median
steady decode step, and that step against its bytes floor: the bytes one step must read over the
device-to-device copy bandwidth measured here, counting only the experts the step's tokens are routed
to (expected distinct experts of B tokens drawing top-k of E at random: E (1 - (1 - k/E)^B) per layer),
plus attention, router and LM head weights, the KV of every sequence, and the LoRA pairs the step
touches (attention's per adapter, experts' per adapter and expert hit).

    python3 benchmarks/moe.py --layers 24                      # one H100 (80 GB), bf16, N = 0 and 16
    python3 benchmarks/moe.py --tensor-parallel-size 2 --enable-expert-parallel   # all 48 layers, EP 2
    python3 benchmarks/moe.py --smoke                          # tiny shape on the CPU (checks it runs)
    python3 benchmarks/moe.py --shape gpt-oss-20b              # gpt-oss-20b's shape (bf16 experts), one H100

Expert LoRA is large: rank r on every expert of every layer is E r (2H + 3I) elements per layer (gate and up share one A; rank 8
at this shape: 0.63 GB per adapter in bf16), so the pool holds --max-loras of them; the adapter files are
--distinct-adapters random ones registered under N names. The 48 layers' weights alone take 61 GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import w1_setup as w1  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(
        num_hidden_layers=48, hidden_size=2048, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936,
    ),
    "smoke": dict(
        num_hidden_layers=2, hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
    ),
    # gpt-oss-20b in bf16 (its hub checkpoint's MXFP4 experts are dequantized at load, so the same bytes):
    # attention sinks, sliding (128) and full layers alternating, biased router and experts.
    "gpt-oss-20b": dict(
        num_hidden_layers=24, hidden_size=2880, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880,
        intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
    ),
    "gpt-oss-smoke": dict(
        num_hidden_layers=2, hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
    ),
}  # fmt: skip
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
GPT_OSS_WINDOW = 128  # gpt-oss's sliding layers (every other one, the first included) see 128 keys


def write_model(path: Path, sizes: dict, gpt_oss: bool = False) -> Path:
    """config.json only: the engine draws the weights on the device (load_format="dummy")."""
    path.mkdir(parents=True, exist_ok=True)
    if gpt_oss:  # transformers' GptOssConfig defaults (YaRN, window 128, swiglu 1.702 / 7.0) otherwise
        layers = sizes["num_hidden_layers"]
        config = {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "rms_norm_eps": 1e-5,
            "num_local_experts": sizes["num_experts"], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "layer_types": [("sliding_attention", "full_attention")[n % 2] for n in range(layers)],
            "sliding_window": GPT_OSS_WINDOW, "attention_bias": True, "max_position_embeddings": 131072,
            **{k: v for k, v in sizes.items() if k not in ("num_experts", "moe_intermediate_size")},
        }  # fmt: skip
        (path / "config.json").write_text(json.dumps(config))
        return path
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "norm_topk_prob": True, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", **sizes,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_adapter(path: Path, sizes: dict, rank: int, seed: int, dtype: torch.dtype) -> Path:
    """A PEFT adapter on q/k/v/o and the routed experts (target_parameters), as PEFT saves it."""
    gen = torch.Generator().manual_seed(seed)
    h, e, i = sizes["hidden_size"], sizes["num_experts"], sizes["moe_intermediate_size"]
    q = sizes["num_attention_heads"] * sizes["head_dim"]
    kv = sizes["num_key_value_heads"] * sizes["head_dim"]
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    tensors = {}

    def pair(name, rows, cols, out):
        tensors[f"{name}.lora_A.weight"] = (torch.randn(rows, cols, generator=gen) * 0.01).to(dtype)
        tensors[f"{name}.lora_B.weight"] = (torch.randn(out, rows, generator=gen) * 0.01).to(dtype)

    for layer in range(sizes["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}"
        for module, (cols, out) in dims.items():
            pair(f"{prefix}.self_attn.{module}", rank, cols, out)
        pair(f"{prefix}.mlp.experts.base_layer", e * rank, h, 2 * i)  # gate_up_proj
        pair(f"{prefix}.mlp.experts", e * rank, i, h)  # down_proj
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank,
        target_modules=list(dims), target_parameters=EXPERTS,
    )  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def floor_bytes(
    sizes,
    batch: int,
    kv_tokens: int,
    adapters: int,
    rank: int,
    element: int,
    window_tokens: int | None = None,
) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences must read, by part. `window_tokens`: the keys the
    sliding layers (every other layer, gpt-oss) read, where the model has them."""
    layers, h, e, k = (
        sizes[n] for n in ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok")
    )
    i, vocab = sizes["moe_intermediate_size"], sizes["vocab_size"]
    q = sizes["num_attention_heads"] * sizes["head_dim"]
    kv = sizes["num_key_value_heads"] * sizes["head_dim"]
    hit = e * (1 - (1 - k / e) ** batch)  # distinct experts per layer
    parts = {
        "attention + router + LM head": element * (layers * (2 * h * q + 2 * h * kv + e * h) + vocab * h),
        "routed experts": element * layers * hit * 3 * h * i,
        "KV cache": element * kv_tokens * layers * 2 * kv
        if window_tokens is None
        else element * 2 * kv * (window_tokens * ((layers + 1) // 2) + kv_tokens * (layers // 2)),
    }
    if adapters:
        per_adapter = batch / adapters
        hit_lora = e * (1 - (1 - k / e) ** per_adapter)
        attention = rank * (2 * (h + q) + 2 * (h + kv))
        experts = hit_lora * rank * (3 * h + 3 * i)
        parts["LoRA pairs"] = element * layers * adapters * (attention + experts)
    return parts


def run(args, model_dir: Path, adapter_dirs: list[Path], num_adapters: int, prompts, window=None) -> dict:
    max_len = max(len(p) for p in prompts) + args.output_tokens
    config = EngineConfig(
        model=str(model_dir), dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len, block_size=16,
        num_kv_blocks=(args.max_num_seqs + 1) * -(-max_len // 16), enable_prefix_caching=False,
        max_loras=max(1, min(num_adapters, args.max_loras)), max_lora_rank=args.rank,
        max_cpu_loras=max(1, num_adapters), enforce_eager=args.enforce_eager, load_format="dummy",
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
    )  # fmt: skip
    engine = LLMEngine(config, skip_tokenizer_init=True)
    try:
        for n in range(num_adapters):
            engine.register_adapter(f"a{n}", str(adapter_dirs[n % len(adapter_dirs)]))
        names = [f"a{n % num_adapters}" if num_adapters else None for n in range(len(prompts))]
        params = SamplingParams(
            temperature=0.0, max_tokens=args.output_tokens, min_tokens=args.output_tokens, ignore_eos=True
        )
        for n, (prompt, name) in enumerate(zip(prompts, names)):  # warm-up: adapters resident, kernels built
            engine.add_request(f"warm{n}", prompt, params, name)
        while engine.has_unfinished_requests():
            engine.step()
        steps, last = [], []
        execute = engine.runner.execute

        def recorded(scheduled, in_flight=None):
            last[:] = scheduled
            return execute(scheduled, in_flight)

        engine.runner.execute = recorded
        device = torch.device(args.device)
        w1.sync(device)
        start = time.perf_counter()
        for n, (prompt, name) in enumerate(zip(prompts, names)):
            engine.add_request(str(n), prompt, params, name)
        while engine.has_unfinished_requests():
            last.clear()
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            if last and all(s.num_new_tokens == 1 for s in last):
                in_step = len({s.request.adapter_id for s in last} - {None})
                keys = [s.start + 1 for s in last]
                windowed = sum(min(n, window) for n in keys) if window else 0
                steps.append((seconds, len(last), sum(keys), in_step, windowed))
        total = time.perf_counter() - start
        engine.runner.execute = execute
    finally:
        engine.shutdown()
    batch = max(s[1] for s in steps)
    steady = [s for s in steps if s[1] == batch] or steps
    return dict(
        adapters=num_adapters,
        tok_s=args.output_tokens * len(prompts) / total,
        step=statistics.median(s[0] for s in steady),
        batch=batch,
        kv_tokens=int(statistics.median(s[2] for s in steady)),
        window_tokens=int(statistics.median(s[4] for s in steady)) if window else None,
        in_step=max(s[3] for s in steady),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (memory)")
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 16])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--distinct-adapters", type=int, default=2, help="adapter files written")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, float32")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape = "gpt-oss-smoke" if args.shape.startswith("gpt-oss") else "smoke"
        args.device, args.dtype, args.adapters = "cpu", "float32", [0, 2]
        args.requests, args.output_tokens, args.max_num_seqs, args.rank = 4, 4, 4, 8
    sizes = dict(SHAPES[args.shape])
    if args.layers:
        sizes["num_hidden_layers"] = args.layers
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    import random

    rng = random.Random(0)
    low, high = (8, 16) if args.smoke else (128, 512)
    prompts = [
        [rng.randrange(3, sizes["vocab_size"]) for _ in range(rng.randint(low, high))]
        for _ in range(args.requests)
    ]
    device = torch.device(args.device)
    bandwidth = w1.copy_bandwidth(device, 1 << (20 if args.smoke else 30))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_model(root / "model", sizes, args.shape.startswith("gpt-oss"))
        distinct = max(1, min(args.distinct_adapters, max(args.adapters)))
        adapter_dtype = getattr(torch, args.dtype)
        adapter_dirs = [
            write_adapter(root / f"adapter{n}", sizes, args.rank, n, adapter_dtype) for n in range(distinct)
        ] if max(args.adapters) else []  # fmt: skip
        for num_adapters in args.adapters:
            window = GPT_OSS_WINDOW if args.shape.startswith("gpt-oss") else None
            results.append(run(args, model_dir, adapter_dirs, num_adapters, prompts, window))
    base = next((r for r in results if r["adapters"] == 0), None)
    where = f"{args.device}, tp {args.tensor_parallel_size}" + (" EP" if args.enable_expert_parallel else "")
    print(f"\nMoE decode, shape {args.shape} ({sizes['num_hidden_layers']} layers), {args.dtype}, {where}, ")
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, rank {args.rank}, {args.requests} requests\n")
    print(
        "| adapters (in step) | output tok/s | decode step ms (batch) | floor ms | step / floor | step / no-LoRA |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        parts = floor_bytes(
            sizes, r["batch"], r["kv_tokens"], r["in_step"], args.rank, element, r["window_tokens"]
        )
        floor = sum(parts.values()) / bandwidth / args.tensor_parallel_size
        ratio = f"{r['step'] / base['step']:.2f}" if base else "-"
        print(
            f"| {r['adapters']} ({r['in_step']}) | {r['tok_s']:.0f} | {r['step'] * 1e3:.2f} ({r['batch']}) | "
            f"{floor * 1e3:.2f} | {r['step'] / floor:.2f} | {ratio} |"
        )
    print("\nSummary: " + "; ".join(f"N={r['adapters']}: {r['tok_s']:.0f} tok/s" for r in results))


if __name__ == "__main__":
    main()
