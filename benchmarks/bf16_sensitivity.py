"""How far transformers + PEFT in bfloat16 is from itself in float32 on the GPU tests' tiny models.

For the DoRA, vocab-adapter and MoE GPU tests' exact models, adapters and prompts: greedy tokens of
transformers + PEFT in float32 (on the CPU) against those of transformers + PEFT in bfloat16 (on
--device) and, with --engine, of the engine in bfloat16. For each: the first-32-token agreement (the old
measure), how many rows diverge, the float32 reference's top-1/top-2 logprob gap where they do, the bf16
token's rank in the float32 distribution there, and the rows failing the top-k check that the bf16 GPU
tests use (tests/factories.py, greedy_divergences).

    OMP_NUM_THREADS=1 python benchmarks/bf16_sensitivity.py [--device cpu] [--cases dora-llama,vocab,...]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
# the repository root in place of this folder (whose lora_kernels.py would shadow the package), then tests'
sys.path[:1] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "engine")]
from factories import (  # noqa: E402
    MOE_ADAPTERS,
    engine_greedy,
    first_tokens_agreement,
    greedy_divergences,
    load_reference_base,
    make_adapter,
    make_model,
)
from formats_fixtures import make_dora_adapter, make_vocab_adapter  # noqa: E402
from peft import PeftModel  # noqa: E402

NUM_TOKENS = 32
TOP_K = 5
DORA = {
    "dora_qv_r4": (make_dora_adapter, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "dora_all_r16": (make_dora_adapter, dict(r=16, lora_alpha=16, target_modules="all-linear")),
    "dora_mlp_r8": (make_dora_adapter, dict(r=8, lora_alpha=16, target_modules=["up_proj", "down_proj"])),
    "lora_r8": (make_adapter, dict(r=8, lora_alpha=16, target_modules="all-linear")),
}
VOCAB = {
    "mts_head": (make_vocab_adapter, dict(r=8, target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "mts_embed": (make_vocab_adapter, dict(r=8, target_modules=["v_proj"], modules_to_save=["embed_tokens"])),
    "lora_embed_head": (
        make_vocab_adapter,
        dict(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens", "lm_head"]),
    ),
    "lora_head_nobase": (make_vocab_adapter, dict(r=4, target_modules=["lm_head"], save_base_layers=False)),
    "plain": (make_adapter, dict(r=16, lora_alpha=16, target_modules="all-linear")),
}
MOE = {name: (make_adapter, kwargs) for name, kwargs in MOE_ADAPTERS.items()}
# name: (arch, model seed, adapters, adapter seed base, prompt rng seed, prompts, prompt lengths), as the tests build them
CASES = {
    "dora-llama": ("llama", 1, DORA, 10, "llama", 20, (17, 60)),
    "dora-qwen2": ("qwen2", 1, DORA, 10, "qwen2", 20, (17, 60)),
    "vocab": ("llama", 2, VOCAB, 30, 7, 18, (9, 40)),
    "moe-qwen3_moe": ("qwen3_moe", 1, MOE, 10, "qwen3_moe", 16, (17, 60)),
    "moe-mixtral": ("mixtral", 1, MOE, 10, "mixtral", 16, (17, 60)),
}


def build(root: Path, name: str):
    arch, seed, adapters, adapter_seed, prompt_seed, num_prompts, lengths = CASES[name]
    model_dir = make_model(root / "model", arch=arch, seed=seed)
    paths = {
        a: make(model_dir, root / a, seed=adapter_seed + i, **kwargs)
        for i, (a, (make, kwargs)) in enumerate(adapters.items())
    }
    rng = random.Random(prompt_seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(*lengths))] for _ in range(num_prompts)]
    names = [*paths, None]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    return model_dir, paths, prompts, assigned


@torch.inference_mode()
def greedy_with_logprobs(model_dir, paths, prompts, assigned, dtype, device):
    """Greedy tokens and each step's log-softmax (float32, [steps, vocab]) of each row, one model per adapter."""
    tokens, logprobs = [None] * len(prompts), [None] * len(prompts)
    for adapter in {*assigned}:
        model = load_reference_base(model_dir)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, paths[adapter]).eval()
        model = model.to(device, dtype)
        for i in (i for i, a in enumerate(assigned) if a == adapter):
            ids = torch.tensor([prompts[i]], device=device)
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                min_new_tokens=NUM_TOKENS, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            tokens[i] = out.sequences[0, len(prompts[i]) :].tolist()
            logprobs[i] = torch.stack([s[0].float().log_softmax(-1) for s in out.logits]).cpu()
    return tokens, logprobs


def engine_with_logprobs(model_dir, paths, prompts, assigned, dtype, device):
    """The engine's greedy tokens and each step's top-TOP_K logprobs (dicts) of each row."""
    from engine import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir), lora_modules={k: str(v) for k, v in paths.items()}, dtype=dtype, device=device,
        skip_tokenizer_init=True, max_loras=len(paths), max_vocab_loras=len(paths), max_lora_rank=16,
        max_num_seqs=16, max_num_batched_tokens=256, max_model_len=128,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=TOP_K)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=assigned)
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
        return [engine_greedy(o) for o in outputs]
    finally:
        llm.engine.shutdown()


def as_tops(logprobs):
    return [
        [dict(zip(*map(torch.Tensor.tolist, step.topk(TOP_K)[::-1]))) for step in rows] for rows in logprobs
    ]


def report(name, fp32, bf16):
    (ref_tokens, ref_lp), (tokens, lp) = fp32, bf16
    agreement = first_tokens_agreement(tokens, ref_tokens, NUM_TOKENS)
    diverged, gaps, ranks = 0, [], []
    for ref, got, ref_rows in zip(ref_tokens, tokens, ref_lp):
        at = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
        if at is None:
            continue
        diverged += 1
        top = ref_rows[at].topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        ranks.append(int((ref_rows[at] > ref_rows[at][got[at]]).sum()))  # bf16 token's rank in fp32 (0 = top)
    tops = lp if isinstance(lp[0][0], dict) else as_tops(lp)  # the engine's are top-k dicts already
    failures = greedy_divergences(list(zip(tokens, tops)), list(zip(ref_tokens, as_tops(ref_lp))), TOP_K)
    print(
        f"{name} bf16 vs PEFT fp32: first-{NUM_TOKENS} agreement {agreement:.3f}; {diverged}/{len(tokens)} rows "
        f"diverge; fp32 top1-top2 logprob gap at the divergence: "
        f"{', '.join(f'{g:.3f}' for g in sorted(gaps))}; bf16 token's fp32 rank: {sorted(ranks)}; "
        f"rows failing the top-{TOP_K} check: {len(failures)} {failures}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--engine", action="store_true", help="also the engine in bf16 on --device")
    args = parser.parse_args()
    for name in args.cases.split(","):
        with tempfile.TemporaryDirectory() as root:
            model_dir, paths, prompts, assigned = build(Path(root), name)
            fp32 = greedy_with_logprobs(model_dir, paths, prompts, assigned, torch.float32, "cpu")
            bf16 = greedy_with_logprobs(model_dir, paths, prompts, assigned, torch.bfloat16, args.device)
            report(f"{name} PEFT", fp32, bf16)
            if args.engine:
                rows = engine_with_logprobs(model_dir, paths, prompts, assigned, "bfloat16", args.device)
                report(f"{name} engine", fp32, ([r[0] for r in rows], [r[1] for r in rows]))


if __name__ == "__main__":
    main()
