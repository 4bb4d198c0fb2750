"""Offline batch generation: `LLM(model=...).generate(prompts, sampling_params, adapters=...)`."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.generation_config import apply_generation_defaults, load_generation_defaults
from engine.llm_engine import LLMEngine
from engine.model.loader import resolve_model_path
from engine.outputs import RequestOutput
from engine.request_meta import RequestMeta
from engine.sampling_params import SamplingParams

PromptInput = str | list[int] | dict


class LLM:
    """Run many prompts, each with its own adapter (or none), through one continuously batched engine.

    `adapters` holds, per prompt, a name registered with `lora_modules`/`register_adapter`, a local PEFT
    folder, or None for the base model. A dict prompt may carry vLLM's `cache_salt` (a non-empty string):
    it then shares prefix-cache blocks only with prompts of the same salt; prompts without one share
    with each other, as before. `priority` (vLLM's, one integer per prompt, lower served first) needs
    `scheduling_policy="priority"`; under another policy a non-zero one raises RequestError, as in vLLM.
    A prompt that cannot be served (too long, unknown adapter) comes back with `error` set and
    `finish_reason` "error"; the others are unaffected.
    Without `sampling_params`, prompts use `get_default_sampling_params()`: the model's recommended
    sampling fields (its generation_config.json) unless `generation_config="vllm"`.

    `shutdown()` (or leaving a `with LLM(...) as llm:` block) frees the engine at once: its GPU memory,
    its adapter loaders and its tensor-parallel workers; another LLM may then start in this process. An
    engine dropped without it (`del llm; gc.collect()`) stops its workers and leaves its process group
    when it is collected.
    """

    def __init__(
        self,
        model: str,
        tokenizer=None,
        skip_tokenizer_init: bool = False,
        lora_modules: dict[str, str] | None = None,
        **engine_args,
    ):
        config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(
            config,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
        )
        try:
            for name, path in (lora_modules or {}).items():
                self.engine.register_adapter(name, path)
        except BaseException:
            self.shutdown()
            raise
        self._next_id = 0
        self._generation_defaults = load_generation_defaults(
            resolve_model_path(model), config.generation_config
        )

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Free the engine now (idempotent): GPU memory, adapter loaders, tensor-parallel workers (each
        wait bounded). `generate` refuses after it."""
        self.engine.shutdown()

    @property
    def closed(self) -> bool:
        return self.engine.closed

    def register_adapter(self, name: str, path: str) -> None:
        self.engine.register_adapter(name, path)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended defaults (as vLLM's `LLM.get_default_sampling_params`)."""
        return apply_generation_defaults(self._generation_defaults)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | None | Sequence[str | None] = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if self.closed:
            raise RuntimeError("this LLM was shut down: start a new one")
        prompts, salts = _as_prompt_list(prompts)
        params = _per_prompt(
            sampling_params or self.get_default_sampling_params(), len(prompts), "sampling_params"
        )
        adapter_list = _per_prompt(adapters, len(prompts), "adapters")
        priorities = _per_prompt(0 if priority is None else priority, len(prompts), "priority")
        metas = [RequestMeta(priority=rank, cache_salt=salt) for rank, salt in zip(priorities, salts)]
        for meta in metas:  # all refused before any is queued
            self.engine.check_meta(meta)
        ids = []
        for prompt, meta, p, adapter in zip(prompts, metas, params, adapter_list):
            request_id = str(self._next_id)
            self._next_id += 1
            ids.append(request_id)
            self.engine.add_request(request_id, prompt, p, adapter, meta=meta)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[request_id] for request_id in ids]


def _as_prompt_list(prompts) -> tuple[list[str | list[int]], list[str | None]]:
    """(the prompts, each one's cache salt: a dict prompt's `cache_salt`, else None)."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    result, salts = [], []
    for prompt in prompts:
        salts.append(prompt.get("cache_salt") if isinstance(prompt, dict) else None)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        result.append(prompt)
    return result, salts


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
