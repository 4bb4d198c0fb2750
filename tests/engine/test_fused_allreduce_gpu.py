"""The fused all-reduce + residual add + RMSNorm on GPUs (skipped without 2 GPUs; the 4-rank cases without 4):

- the kernel over 2 and 4 ranks (one spawned process per GPU, NCCL group, torch symmetric memory) against
  the unfused ops (sum of the partials rounded once, bias, fused_ops.rms_norm: the residual bitwise, the
  output to its last bit) and a float64 reference, outputs poisoned first, several sizes and dtypes,
  Gemma's offset and a bias;
- 64 calls back to back with new inputs each, NCCL all-reduces between some, checked after all ran;
- two calls captured in a CUDA graph, replayed 20 times with new inputs;
- the engine: C1 in float32 at tp 2 with the fused path on gives transformers + PEFT's greedy tokens (as
  tp 1 and tp 2 with it off do), decode graphs replayed and the kernel counted; three engines with it
  on, one after another in one process (symmetric memory set up anew for each group), bounded.

    NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 python -m pytest tests/engine/test_fused_allreduce_gpu.py -m gpu -q
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import random
import traceback

import pytest
import torch
from factories import C1_ADAPTERS, load_peft_reference, make_adapter, make_model, reference_greedy

from engine import LLM, SamplingParams

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # children inherit it (NVLink multicast off)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
    ),
]
RANK_TIMEOUT_S = 240.0
EPS = 1e-6
# (tokens, hidden, dtype, offset, bias): decode sizes, a hidden size that is not a power of two, the
# largest input the bound takes at tp 2 for bf16 8192 (256 tokens), and one more token than programs.
CASES = [
    (1, 4096, torch.bfloat16, False, False),
    (7, 8192, torch.bfloat16, False, True),
    (65, 4096, torch.float16, True, False),
    (128, 8192, torch.bfloat16, False, False),
    (33, 3072, torch.float32, False, False),
    (3, 5120, torch.float32, True, True),
]


def gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


# -- spawned ranks ----------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, check: str, results) -> None:
    """One rank: join the NCCL group, set the fused path up, run `check`, report (rank, error, result)."""
    try:
        from engine.parallel.group import ParallelGroup

        group = ParallelGroup.join(rank, world, port, torch.device("cuda", rank))
        group.use_fused_add_norm(True)
        assert group.fused_add_norm is not None, "the fused all-reduce was not set up"
        results.put((rank, None, CHECKS[check](group)))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    results.close()
    results.join_thread()
    os._exit(0)  # no NCCL teardown (engine/parallel/group.py says why)


def run_ranks(world: int, check: str) -> list:
    from engine.parallel.group import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, check, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < world:
            try:
                rank, error, result = results.get(timeout=RANK_TIMEOUT_S)
            except queue_module.Empty:
                pytest.fail(f"{check}: ranks {sorted(set(range(world)) - set(got))} did not report in time")
            assert error is None, f"rank {rank}:\n{error}"
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [got[r] for r in range(world)]


def _inputs(case, world: int, seed: int, device):
    tokens, hidden, dtype, offset, with_bias = case
    g = torch.Generator(device=device).manual_seed(seed)
    partials = torch.randn(world, tokens, hidden, generator=g, device=device).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    weight = (torch.rand(hidden, generator=g, device=device) + 0.5).to(dtype)
    bias = torch.randn(hidden, generator=g, device=device).to(dtype) if with_bias else None
    return partials, residual, weight, bias


def _unfused(partials, residual, weight, bias, offset):
    from engine.model import fused_ops

    x = partials.float().sum(0).to(partials.dtype)
    if bias is not None:
        x = x + bias
    residual = residual.clone()
    return fused_ops.rms_norm(x, weight, EPS, residual, offset), residual


def _reference64(partials, residual, weight, bias, offset):
    x = partials.double().sum(0) + residual.double()
    if bias is not None:
        x = x + bias.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return normed * ((1.0 + weight.double()) if offset else weight.double())


def _poisoned(like: torch.Tensor, dtype) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=dtype, device=like.device)


# Output against the unfused ops: the norm's sum of squares may add in another order (another Triton
# layout), so a last-bit difference is allowed; the residual (sum of partials, bias, residual add: no
# reduction order involved) must be bitwise the unfused ops'.
OUT_TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def assert_out_close(out, want, what: str) -> None:
    tol = OUT_TOL[out.dtype]
    torch.testing.assert_close(out, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def assert_unfused(out, residual, want, want_residual, what: str) -> None:
    assert torch.equal(residual, want_residual), f"{what}: residual differs from the unfused ops"
    assert_out_close(out, want, what)


def _check_one(fused, case, world, rank, seed, device) -> None:
    partials, residual, weight, bias = _inputs(case, world, seed, device)
    offset = case[3]
    want, want_residual = _unfused(partials, residual, weight, bias, offset)
    out, mine = _poisoned(want, want.dtype), residual.clone()
    fused(partials[rank].clone(), mine, weight, EPS, offset, bias, out=out)
    assert_unfused(out, mine, want, want_residual, str(case))
    tol = 1e-4 if case[2] == torch.float32 else 5e-2
    reference = _reference64(partials, residual, weight, bias, offset)
    torch.testing.assert_close(out.double(), reference, rtol=tol, atol=tol)


def check_cases(group) -> int:
    device, world, rank = group.device, group.world_size, group.rank
    fused = group.fused_add_norm
    checked = 0
    for i, case in enumerate(CASES):
        if not fused.fits(torch.empty(case[0], case[1], dtype=case[2], device=device)):
            continue  # past the bound at this world size (NCCL's then)
        _check_one(fused, case, world, rank, seed=100 + i, device=device)
        checked += 1
    return checked


def check_back_to_back(group) -> int:
    """64 calls queued without a host sync between them (every rank the same), NCCL between some."""
    import torch.distributed as dist

    device, world, rank = group.device, group.world_size, group.rank
    fused = group.fused_add_norm
    pending = []
    for i in range(64):
        case = CASES[i % 2]  # 1 and 7 tokens: the decode sizes where waits are shortest
        partials, residual, weight, bias = _inputs(case, world, seed=1000 + i, device=device)
        mine = residual.clone()
        out = fused(partials[rank].clone(), mine, weight, EPS, case[3], bias)
        pending.append((out, mine, _unfused(partials, residual, weight, bias, case[3])))
        if i % 8 == 3:
            dist.all_reduce(torch.ones(16, device=device), group=group.group)
    torch.cuda.synchronize(device)
    for i, (out, mine, (want, want_residual)) in enumerate(pending):
        assert_unfused(out, mine, want, want_residual, f"call {i}")
    return fused.calls()


def check_cuda_graph(group) -> int:
    """Two fused calls captured in one graph (as a decode step's layers are), replayed with new inputs."""
    device, world, rank = group.device, group.world_size, group.rank
    fused = group.fused_add_norm
    case = (16, 4096, torch.bfloat16, False, False)
    partials, residual, weight, _ = _inputs(case, world, seed=7, device=device)
    static_partial, static_partial2 = partials[rank].clone(), partials[rank].clone()
    static_residual = residual.clone()
    fused(static_partial, static_residual.clone(), weight, EPS, False, None)  # compiled before capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = fused(static_partial, static_residual, weight, EPS, False, None)
        second = fused(static_partial2, static_residual, weight, EPS, False, None)
    for replay in range(20):
        p1, res, _, _ = _inputs(case, world, seed=500 + replay, device=device)
        p2, _, _, _ = _inputs(case, world, seed=900 + replay, device=device)
        static_partial.copy_(p1[rank])
        static_partial2.copy_(p2[rank])
        static_residual.copy_(res)
        first.fill_(float("nan"))
        second.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
        want1, residual1 = _unfused(p1, res, weight, None, False)
        want2, residual2 = _unfused(p2, residual1, weight, None, False)
        assert_out_close(first, want1, f"replay {replay}")
        assert_unfused(second, static_residual, want2, residual2, f"replay {replay}")
    return fused.calls()


CHECKS = {"cases": check_cases, "back_to_back": check_back_to_back, "cuda_graph": check_cuda_graph}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=gpus(4))])
def test_kernel_matches_the_unfused_ops_over_ranks(world):
    checked = run_ranks(world, "cases")
    assert checked[0] >= 4 and len(set(checked)) == 1


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=gpus(4))])
def test_back_to_back_calls_never_mix_up_inputs(world):
    assert run_ranks(world, "back_to_back") == [64] * world


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=gpus(4))])
def test_captured_in_a_cuda_graph_and_replayed(world):
    assert run_ranks(world, "cuda_graph") == [1 + 2 * 20] * world


# -- the engine -------------------------------------------------------------------------------------------

NUM_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
ENGINE_ARGS = dict(
    max_loras=2, max_lora_rank=16, dtype="float32", max_num_seqs=16, max_num_batched_tokens=16, block_size=16
)


@pytest.fixture(scope="module")
def c1_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused-ar")
    model_dir = make_model(root / "model", arch="qwen2", seed=1)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(C1_ADAPTERS.items())
    }
    rng = random.Random(7)
    names = [*adapters, None]
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 41))] for _ in range(15)]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    reference_model = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference_model, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    return dict(model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned, expected=expected)


def _c1_tokens(case, tp: int, fused: bool) -> tuple[list, int]:
    """Greedy tokens, and how many fused calls rank 0 made (0 when off)."""
    with LLM(
        model=str(case["model_dir"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        tensor_parallel_size=tp,
        fused_allreduce=fused,
        **ENGINE_ARGS,
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in case["prompts"]], GREEDY, case["assigned"])
        assert llm.engine.stats().num_decode_graph_replays > 0
        parallel = llm.engine.runner.parallel
        kernel = None if parallel is None else parallel.group.fused_add_norm
        assert (kernel is not None) == (fused and tp > 1)
        calls = 0 if kernel is None else kernel.calls()
    return [o.outputs[0].token_ids for o in outputs], calls


def test_engine_tokens_with_the_fused_path_equal_without_it_and_one_gpu(c1_case):
    fused, calls = _c1_tokens(c1_case, 2, True)
    assert calls > 0, "the fused kernel never ran"
    assert fused == c1_case["expected"]  # transformers + PEFT's, float32
    assert _c1_tokens(c1_case, 2, False)[0] == fused
    assert _c1_tokens(c1_case, 1, True)[0] == fused  # the setting does nothing on one GPU


CYCLES = """
import sys, time
from engine import LLM, SamplingParams
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
first = None
for cycle in range(int(sys.argv[2])):
    started = time.monotonic()
    with LLM(model=sys.argv[1], tensor_parallel_size=2, dtype="bfloat16", max_num_seqs=16,
             skip_tokenizer_init=True, gpu_memory_utilization=0.3, fused_allreduce=True) as llm:
        outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8 + i]} for i in range(8)], params)
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert llm.engine.runner.parallel.group.fused_add_norm.calls() > 0, "the fused kernel never ran"
    first = first or tokens
    assert tokens == first, "another engine in the same process gave other tokens"
    print(f"cycle {cycle} {time.monotonic() - started:.1f}", flush=True)
"""


def test_engines_with_it_come_and_go_in_one_process(c1_case, tmp_path):
    """Symmetric memory set up again for each new engine's group (3 cycles in a child process, bounded)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "cycles.log"
    with log.open("w") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", CYCLES, str(c1_case["model_dir"]), "3"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            code = child.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
            pytest.fail(f"3 cycles did not finish within 240 s:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert sum(line.startswith("cycle ") for line in text.splitlines()) == 3, text[-3000:]
