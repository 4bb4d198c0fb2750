"""Build the app's parts around a tiny random Llama with a real tokenizer and a chat template (no hub).

Plain functions, not fixtures, so test modules of several folders can share them:
`make_text_model(folder)` writes the model; `open_test_services(...)` yields a `Services` with a real
engine, local adapter store, embedded config store, authenticator, router, limiter and metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from factories import make_model
from loraserve.config_store import CachedConfigStore, EmbeddedConfigStore
from loraserve.merges.service import Merges
from loraserve.ops.metrics import Metrics
from loraserve.routing import Router
from loraserve.services import Services
from loraserve.tenancy import Authenticator, ConcurrencyLimiter, parse_api_keys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from adapters_store import DiskCache, StoreConfig, open_store
from adapters_store.engine_source import StoreAdapterSource
from adapters_store.merged_source import MergedAdapterSource
from engine import AsyncLLM, EngineConfig, model_shape
from engine.model.loader import load_config

EOS = "<|endoftext|>"
# A ChatML-style template like SmolLM2's: enough to show the server renders whatever the tokenizer ships.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "user assistant system: what is the answer? The answer is 42.",
    "stop here. STOP there. The end. Once upon a time there was a model.",
] * 4
MAX_MODEL_LEN = 128


def make_tokenizer(
    chat_template: str | None = CHAT_TEMPLATE, corpus: list[str] = CORPUS, vocab_size: int = 300
) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, clean_up_tokenization_spaces=False
    )
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped


def make_text_model(
    folder: Path,
    seed: int = 5,
    chat_template: str | None = CHAT_TEMPLATE,
    arch: str = "llama",
    tokenizer: PreTrainedTokenizerFast | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> Path:
    """A C1-sized random model (Llama, or another family of tests/factories.py) saved with its tokenizer
    (make_tokenizer's unless given); eos is token 0."""
    tokenizer = tokenizer or make_tokenizer(chat_template)
    make_model(
        folder,
        arch=arch,
        seed=seed,
        vocab_size=len(tokenizer),
        eos_token_id=0,
        bos_token_id=None,
        max_position_embeddings=max_model_len,
    )
    tokenizer.save_pretrained(folder)
    return folder


def keys_for(**tenants: tuple[str, str, int | None]) -> dict:
    """keys_for(alice=("sk-a", "admin", None)) -> the --api-keys mapping."""
    return {
        key: {"tenant": tenant, "role": role, **({"max_concurrent_requests": limit} if limit else {})}
        for tenant, (key, role, limit) in tenants.items()
    }


@contextlib.asynccontextmanager
async def open_test_services(
    root: Path,
    model_dir: Path,
    *,
    api_keys: dict | None = None,
    max_concurrent: int | None = None,
    num_kv_blocks: int = 96,
    max_loras: int = 2,
    store_config: StoreConfig | None = None,
    config_store: CachedConfigStore | None = None,
    max_logprobs: int = 20,
    speculative_config: dict | None = None,
    max_num_seqs: int = 16,
    prompt_tokens_details: bool = False,
    scheduling_policy: str = "fair",
) -> AsyncIterator[Services]:
    """`store_config` (e.g. S3) replaces the local store under `root`; `config_store` the embedded one."""
    shape = model_shape(load_config(model_dir))  # sizes and the architecture's LoRA targets
    store_config = store_config or StoreConfig(url=f"file://{root / 'adapters'}", max_lora_rank=16)
    store = open_store(store_config, shape)
    cache = DiskCache(store, root / "cache", 1 << 30)
    config_store = config_store or CachedConfigStore(EmbeddedConfigStore(root / "config"))
    await config_store.start()
    engine = None
    built: list[Services] = []  # the Services below, for the adapter store gauge
    metrics = Metrics(
        "tiny",
        lambda: engine.stats() if engine is not None else None,
        lambda: config_store.healthy,
        lambda: built[0].adapter_lookup.store_up if built else True,
        cache.cached_versions,
    )
    config = EngineConfig(
        model=str(model_dir),
        max_model_len=MAX_MODEL_LEN,
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_loras=max_loras,
        max_lora_rank=16,
        max_num_seqs=max_num_seqs,
        max_logprobs=max_logprobs,
        speculative_config=speculative_config,
        scheduling_policy=scheduling_policy,
    )
    # The engine core runs in its own process, as in `loraserve serve`.
    engine = AsyncLLM.from_config(
        config,
        adapter_source=MergedAdapterSource(
            StoreAdapterSource(store, cache, shape, 16, observer=metrics.adapter_event), root / "merges"
        ),
        adapter_observer=metrics.adapter_event,
        startup_timeout_s=120,
    )
    try:
        keys = parse_api_keys(api_keys) if api_keys else []
        services = Services(
            base_model_id="tiny",
            engine=engine,
            adapter_store=store,
            disk_cache=cache,
            config_store=config_store,
            authenticator=await Authenticator.create(keys, config_store),
            router=Router(on_pick=metrics.route_picked),
            limiter=ConcurrencyLimiter(max_concurrent),
            metrics=metrics,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            max_logprobs=max_logprobs,
            prompt_tokens_details=prompt_tokens_details,
            merges=Merges(root / "merges", shape, 16, "tiny"),
        )
        built.append(services)
        yield services
    finally:
        engine.shutdown()
        await config_store.close()
