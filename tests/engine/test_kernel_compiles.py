"""The compile counter (Triton's JIT hooks, called here as Triton calls them) and the engine's ready mark;
the start-up warm-up's synthetic steps leave the engine's results unchanged."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from triton import knobs

from engine import LLM, SamplingParams, kernel_compiles, warmup
from engine.kernel_compiles import CompileCounter


def fire_compile(name: str = "my_kernel") -> None:
    """What Triton's JITFunction._do_compile does around one compile."""
    info = dict(key="k", repr=name, fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False)
    knobs.runtime.jit_cache_hook(**info, already_compiled=False)
    knobs.runtime.jit_post_compile_hook(**info, already_compiled=False)


@pytest.fixture
def fresh_hooks(monkeypatch):
    """A process with no counter installed yet and someone else's hooks in place."""
    seen = []
    monkeypatch.setattr(kernel_compiles, "_counter", None)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("before", kw["repr"])))
    monkeypatch.setattr(
        knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("after", kw["repr"]))
    )
    return seen


def test_counter_counts_each_compile_and_keeps_earlier_hooks(fresh_hooks):
    counter = kernel_compiles.install()
    assert kernel_compiles.install() is counter
    fire_compile("paged_attention_kernel")
    fire_compile("_shrink_gathered_kernel")
    assert counter.num_compiles == 2
    assert list(counter.recent) == ["paged_attention_kernel", "_shrink_gathered_kernel"]
    assert counter.compile_seconds >= 0.0
    assert fresh_hooks == [
        ("before", "paged_attention_kernel"),
        ("after", "paged_attention_kernel"),
        ("before", "_shrink_gathered_kernel"),
        ("after", "_shrink_gathered_kernel"),
    ]


def test_before_hook_never_skips_a_compile():
    """Triton skips the compile when jit_cache_hook returns True."""
    assert not CompileCounter().before(key="k", fn=None)


def test_compiles_after_ready_are_counted_and_logged(text_model_dir, fresh_hooks, caplog):
    engine = LLM(model=str(text_model_dir), max_model_len=64, block_size=4, max_num_seqs=4).engine
    assert engine.stats().num_kernel_compiles_after_ready == 0
    with caplog.at_level(logging.WARNING, logger="engine.kernel_compiles"):
        fire_compile("late_kernel")
    assert engine.stats().num_kernel_compiles_after_ready == 1
    assert "late_kernel" in caplog.text
    engine.mark_ready()  # a server that warms up more starts counting again
    assert engine.stats().num_kernel_compiles_after_ready == 0


def test_warm_up_leaves_results_unchanged(text_model_dir, text_adapters):
    """The warm-up's synthetic steps write the KV cache and run the sampler: greedy and seeded outputs
    afterwards must match an engine that never warmed up (on the CPU it runs only when asked)."""

    def make():
        return LLM(
            model=str(text_model_dir),
            lora_modules={k: str(v) for k, v in text_adapters.items()},
            max_loras=2,
            max_lora_rank=8,
            max_model_len=64,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=32,
        )

    prompts = ["The quick brown fox", "hello there", "café crème", "one two three four five"]
    adapters = ["alpha", None, "beta", "alpha"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=30, seed=7, max_tokens=10, ignore_eos=True),
    ]
    expected = [make().generate(prompts, p, adapters=adapters) for p in params]
    llm = make()
    warmup.warm_up(llm.engine.runner, llm.engine.sampler)
    got = [llm.generate(prompts, p, adapters=adapters) for p in params]
    for exp, out in zip(expected, got):
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in exp]


def test_warmup_batches_are_valid_steps(text_model_dir):
    runner = LLM(model=str(text_model_dir), max_model_len=64, block_size=4, max_num_seqs=4).engine.runner
    batches = warmup.WarmupBatches(runner)
    for num_tokens in (1, 2, 5, 63, 64, 190, 191, 252):  # 4 sequences of at most 63 new tokens
        batch = batches.mixed(num_tokens, use_lora=True)
        assert len(batch) <= 4
        assert sum(s.num_new_tokens for s in batch) == num_tokens
        if 1 < num_tokens <= 1 + 3 * 63:  # a decode row beside the chunks while they leave room
            assert batch[0].num_new_tokens == 1 and batch[0].start > 0
        for s in batch:
            assert s.samples and s.start + s.num_new_tokens <= runner.max_model_len
            assert len(s.block_ids) * runner.block_size >= s.start + s.num_new_tokens
            assert all(0 <= b < runner.num_kv_blocks for b in s.block_ids)
    decode = batches.decode(3, use_lora=True)
    assert [s.num_new_tokens for s in decode] == [1, 1, 1]
    assert [s.request.lora_slot for s in decode] == [0, -1, 0]
