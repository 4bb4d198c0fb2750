"""Speculative decoding: TPOT at batch 1, 8 and 64, with and without speculation, on a prompt-copying workload.

    TRITON_INTERPRET=0 python3 benchmarks/speculative.py                  # shape S (Llama-3.2-1B), bf16
    python3 benchmarks/speculative.py --num-speculative-tokens 3 --edit-rate 0.2
    python3 benchmarks/speculative.py --adapters 8      # every request on one of 8 adapters, mixed
    python3 benchmarks/speculative.py --draft-model     # also method draft_model (a 2-layer echo model)
    python3 benchmarks/speculative.py --eager-verification   # also ngram with eager verification steps
    python3 benchmarks/speculative.py --smoke           # tiny shapes on the CPU (checks that it runs)

The workload ("rewrite this text with one change"): a random-weight model forced to echo. Its attention
and MLP outputs are zeroed (o_proj and down_proj are 0, everything else random, so each step costs what a
real model of the shape costs) and its lm_head maps each token to its successor on a fixed permutation
of the vocabulary made of cycles of `--cycle` tokens: greedy decoding walks a cycle. A prompt is two laps
of a cycle in which each token is replaced by a random one with probability `--edit-rate`; the output
continues the cycle, so it copies text that occurs in the prompt, except where the prompt was edited.
n-gram lookup proposes what followed in the prompt: proposals after an edit are rejected. Adapters (rank
16, on q/k/v/gate/up) cost what they cost but cannot change this output, since o_proj and down_proj are 0.

Each condition is one engine (start-up excluded); each batch size runs once unmeasured (warm), then
measured. TPOT: (last token - first token) / (output tokens - 1) per request, the median over requests.
Verification steps replay CUDA graphs of their own (engine/spec_decode/verify_graphs.py: a lane of k + 1
rows per request), decode steps without proposals the decode graphs; the "verify graphs" column is the
share of a run's steps that replayed a verification graph. `--eager-verification` adds the condition
`"cuda_graphs": false` (verification steps eager, as before those graphs). The baseline runs with the
engine's defaults (async scheduling on); speculation runs steps one at a time (it turns async
scheduling off).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The repo root first: this folder's lora_kernels.py must not shadow the lora_kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import w1_setup as w1  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

FIRST_TOKEN = 3  # ids below stay out of the cycles (special tokens of real vocabularies)
ADAPTER_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


# -- the echo model ----------------------------------------------------------------------------------


def successor_map(vocab: int, cycle: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """(successor of each token id, the cycles): a random permutation of [FIRST_TOKEN, vocab) cut into
    cycles of `cycle` tokens; tokens below FIRST_TOKEN (and a short tail) map to themselves."""
    ids = list(range(FIRST_TOKEN, vocab))
    random.Random(seed).shuffle(ids)
    successor = list(range(vocab))
    cycles = [ids[i : i + cycle] for i in range(0, len(ids) - cycle + 1, cycle)]
    for members in cycles:
        for a, b in zip(members, members[1:] + members[:1]):
            successor[a] = b
    return successor, cycles


def make_echo_model(
    path: Path, shape: str, dtype, device, successor: list[int], num_layers: int | None = None
):
    """W1's random model, made to echo: o_proj and down_proj zeroed (the residual stream is the token's
    embedding), lm_head row successor[x] = embedding of x (so argmax is the successor: a random vector is
    far closer to itself than to any of 128k others)."""
    overrides = {} if num_layers is None else {"num_hidden_layers": num_layers}
    saved = dict(w1.SHAPES[shape])
    w1.SHAPES[shape] = {**saved, **overrides, "tie_word_embeddings": False}
    try:
        w1.make_model(path, shape, dtype, device)
    finally:
        w1.SHAPES[shape] = saved
    tensors = load_file(str(path / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    embed = tensors["model.embed_tokens.weight"]
    lm_head = torch.empty_like(embed)
    lm_head[torch.tensor(successor)] = embed
    tensors["lm_head.weight"] = lm_head
    save_file(tensors, str(path / "model.safetensors"))
    return path


def make_adapters(root: Path, model_dir: Path, config, count: int, dtype) -> list[Path]:
    """Rank-16 PEFT folders on q/k/v/gate/up (which cannot change the echo: their paths end in zeros)."""
    from peft import LoraConfig

    dims = w1.module_dims(config)
    paths = []
    for a in range(count):
        gen = torch.Generator().manual_seed(100 + a)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module in ADAPTER_MODULES:
                fan_in, fan_out = dims[module]
                block = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj")) else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(16, fan_in, generator=gen) * 0.01).to(dtype)
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, 16, generator=gen) * 0.01).to(dtype)
        path = root / f"adapter{a}"
        LoraConfig(
            r=16, lora_alpha=32, target_modules=list(ADAPTER_MODULES), task_type="CAUSAL_LM"
        ).save_pretrained(str(path))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        paths.append(path)
    return paths


def make_prompts(cycles: list[list[int]], count: int, vocab: int, edit_rate: float, seed: int = 1):
    """Two laps of a cycle from a random start, each token but the last few edited with `edit_rate`."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        members = cycles[i % len(cycles)]
        start = rng.randrange(len(members))
        walk = [members[(start + j) % len(members)] for j in range(2 * len(members))]
        for j in range(len(walk) - 4):
            if rng.random() < edit_rate:
                walk[j] = rng.randrange(FIRST_TOKEN, vocab)
        prompts.append(walk)
    return prompts


# -- runs ------------------------------------------------------------------------------------------------


def make_engine(args, model_dir: Path, adapters: list[Path], max_len: int, speculative_config) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
        block_size=16,
        num_kv_blocks=(max(args.batch_sizes) + 1) * -(-max_len // 16),
        enable_prefix_caching=False,
        max_loras=max(1, len(adapters)),
        max_lora_rank=16,
        enforce_eager=args.enforce_eager,
        speculative_config=speculative_config,
    )
    engine = LLMEngine(config, skip_tokenizer_init=True)
    for i, path in enumerate(adapters):
        engine.register_adapter(f"a{i}", str(path))
    return engine


def run_batch(args, engine: LLMEngine, prompts: list[list[int]], tag: str) -> dict:
    """All prompts at once; per-request TPOT, and the speculative counters' change over the run."""
    device = torch.device(args.device)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    names = [f"a{i % args.adapters}" if args.adapters else None for i in range(len(prompts))]
    before = engine.stats().spec_decode
    verify_graphs = engine.runner.verify_graphs
    replays_before = verify_graphs.num_replays if verify_graphs is not None else 0
    num_steps = 0
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    w1.sync(device)
    start = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, names)):
        engine.add_request(f"{tag}-{i}", prompt, params, adapter)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_steps += 1
        now = time.perf_counter()
        for out in outputs:
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
    seconds = time.perf_counter() - start
    n = args.output_tokens
    tpot = [(done[r] - first[r]) / (n - 1) for r in done]
    after = engine.stats().spec_decode
    result = {"tpot": statistics.median(tpot), "tokens_per_s": n * len(prompts) / seconds}
    if after is not None:
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        drafts = after.num_drafts - before.num_drafts
        result["acceptance"] = accepted / drafted if drafted else float("nan")
        result["accepted_per_draft"] = accepted / drafts if drafts else float("nan")
    if verify_graphs is not None:
        result["verify_graph_steps"] = (verify_graphs.num_replays - replays_before) / num_steps
    return result


def run_condition(args, name, model_dir, adapters, prompts, max_len, speculative_config) -> dict[int, dict]:
    w1.free_memory(torch.device(args.device))
    started = time.perf_counter()
    engine = make_engine(args, model_dir, adapters, max_len, speculative_config)
    print(f"{name}: start-up {time.perf_counter() - started:.1f} s", flush=True)
    results = {}
    for size in args.batch_sizes:
        batch = prompts[:size]
        run_batch(args, engine, batch, f"warm{size}")
        results[size] = run_batch(args, engine, batch, f"run{size}")
        print(f"  batch {size}: TPOT {results[size]['tpot'] * 1e3:.2f} ms", flush=True)
    compiles = engine.stats().num_kernel_compiles_after_ready
    if compiles:
        print(f"  {compiles} Triton kernels compiled after ready", flush=True)
    engine.shutdown()
    del engine
    return results


def report(args, conditions: dict[str, dict[int, dict]]) -> str:
    base = conditions["no speculation"]
    lines = [
        f"Shape {args.shape}, {args.dtype}, prompts {2 * args.cycle} tokens (edit rate {args.edit_rate}), "
        f"{args.output_tokens} output tokens, adapters {args.adapters or 'none'}, "
        f"k = {args.num_speculative_tokens}.",
        "",
        "| condition | batch | TPOT ms (median) | speed-up | output tok/s | acceptance rate | accepted per draft "
        "| verify graphs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, results in conditions.items():
        for size, r in results.items():
            speedup = base[size]["tpot"] / r["tpot"]
            acceptance = f"{r['acceptance']:.2f}" if "acceptance" in r else "-"
            per_draft = f"{r['accepted_per_draft']:.2f}" if "accepted_per_draft" in r else "-"
            graphs = f"{r['verify_graph_steps']:.0%}" if "verify_graph_steps" in r else "-"
            lines.append(
                f"| {name} | {size} | {r['tpot'] * 1e3:.2f} | {speedup:.2f}x | {r['tokens_per_s']:.0f} "
                f"| {acceptance} | {per_draft} | {graphs} |"
            )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="S", choices=sorted(w1.SHAPES))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--cycle", type=int, default=192, help="tokens per cycle; prompts are two laps")
    p.add_argument("--edit-rate", type=float, default=0.1, help="share of prompt tokens replaced at random")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--adapters", type=int, default=0, help="distinct adapters, assigned round robin")
    p.add_argument("--draft-model", action="store_true", help="also method draft_model (a 2-layer echo)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument(
        "--eager-verification", action="store_true", help="also ngram with verification steps eager"
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in either condition")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args(argv)
    args.device, args.dtype = "cuda", "bfloat16"
    if args.smoke:
        args.shape, args.device, args.dtype = "smoke", "cpu", "float32"
        args.batch_sizes, args.output_tokens, args.cycle = [1, 4], 16, 24
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = w1.llama_config(args.shape)
    successor, cycles = successor_map(config.vocab_size, args.cycle)
    prompts = make_prompts(cycles, max(args.batch_sizes), config.vocab_size, args.edit_rate)
    max_len = 2 * args.cycle + args.output_tokens + args.num_speculative_tokens + 1
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_echo_model(Path(tmp) / "model", args.shape, dtype, device, successor)
        adapters = make_adapters(Path(tmp), model_dir, config, args.adapters, dtype)
        conditions = {
            "no speculation": run_condition(
                args, "no speculation", model_dir, adapters, prompts, max_len, None
            ),
            f"ngram k={args.num_speculative_tokens}": run_condition(
                args, "ngram", model_dir, adapters, prompts, max_len, ngram
            ),
        }
        if args.eager_verification:
            conditions[f"ngram k={args.num_speculative_tokens}, eager verification"] = run_condition(
                args,
                "ngram, eager verification",
                model_dir,
                adapters,
                prompts,
                max_len,
                {**ngram, "cuda_graphs": False},
            )
        if args.draft_model:
            draft_dir = make_echo_model(
                Path(tmp) / "draft", args.shape, dtype, device, successor, num_layers=2
            )
            draft = {
                "method": "draft_model",
                "model": str(draft_dir),
                "num_speculative_tokens": args.num_speculative_tokens,
            }
            conditions[f"draft_model k={args.num_speculative_tokens}"] = run_condition(
                args, "draft_model", model_dir, adapters, prompts, max_len, draft
            )
    print()
    print(report(args, conditions))
    print()
    print(json.dumps({name: {str(k): v for k, v in r.items()} for name, r in conditions.items()}))


if __name__ == "__main__":
    main()
