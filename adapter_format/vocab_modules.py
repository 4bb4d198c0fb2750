"""An adapter's own token embedding and LM head: PEFT's `modules_to_save` and LoRA on `embed_tokens` and
`lm_head`, read as PEFT saves and loads them.

What a checkpoint may hold, per vocabulary module (`embed_tokens`, `lm_head`), and what PEFT computes:

- `model.embed_tokens.weight` / `lm_head.weight` [vocab, hidden]: a whole replacement matrix. Saved by
  `modules_to_save` (PEFT's ModulesToSaveWrapper: this adapter's own copy) or by `save_embedding_layers`
  (loaded over the base weights). Either way this adapter runs on it.
- `embed_tokens.lora_embedding_A` [r, vocab] and `lora_embedding_B` [hidden, r]: LoRA on the embedding,
  row `scale * B @ A[:, id]` added to the looked-up row (before an embedding scale such as Gemma's
  sqrt(hidden), which PEFT applies to both); `lm_head.lora_A.weight` [r, hidden] and `lora_B.weight`
  [vocab, r]: LoRA on the head, as on any linear projection.
- `*.base_layer.weight` [vocab, hidden]: the base weights PEFT saves beside LoRA on that module
  (`save_embedding_layers="auto"` does when embed_tokens or lm_head is a target) and loads back over the
  base: the matrix this adapter's LoRA is added to.

Tied embeddings (`tie_word_embeddings`): a saved `embed_tokens` copy under `modules_to_save` is the
embedding only (PEFT's copy breaks the tie; the head stays the base's) unless the config sets
`ensure_weight_tying`, which ties the head to the same copy. A matrix saved outside `modules_to_save` is
loaded into the tied parameter, so it is both. LoRA on a tied pair with `ensure_weight_tying` is refused.

A matrix with more rows than the base vocabulary belongs to a tokenizer that added tokens (resized
embeddings): refused, naming the problem, since requests are tokenized with the base model's tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adapter_format.errors import AdapterError, show_value
from adapter_format.model_shape import ModelShape

if TYPE_CHECKING:
    from adapter_format.peft_config import LoraSettings

VOCAB_MODULES = ("embed_tokens", "lm_head")
# How PEFT names the module among the base model's (what target_modules, rank_pattern, alpha_pattern see).
VOCAB_MODULE_KEYS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}

_VOCAB_TENSOR = re.compile(
    r"^(?:.*\.)?(?P<module>embed_tokens|lm_head)\.(?:"
    r"(?P<full>weight)|base_layer\.(?P<base>weight)|lora_(?P<ab>[AB])\.weight|lora_embedding_(?P<eab>[AB]))$"
)
FULL, BASE = "full", "base"


def vocab_tensor(name: str) -> tuple[str, str] | None:
    """(module, part) of a vocabulary module's tensor, part one of "full", "base", "A", "B"; else None."""
    match = _VOCAB_TENSOR.match(name)
    if match is None:
        return None
    part = FULL if match["full"] else BASE if match["base"] else (match["ab"] or match["eab"])
    if (match["eab"] is not None) != (match["module"] == "embed_tokens") and part in ("A", "B"):
        return None  # lora_embedding_* on lm_head, lora_A/B on the embedding: PEFT never saves those
    return match["module"], part


@dataclass(frozen=True)
class VocabModule:
    """One vocabulary module of an adapter: its whole matrix, its LoRA, or both (LoRA over a saved base).

    `matrix` [vocab, hidden] replaces the base's (None: the base's own); `left` [vocab, r] and `right`
    [r, hidden] are the LoRA factors as one product, `matrix += scale * left @ right` (the embedding's
    A^T and B^T, the head's B and A)."""

    kind: str  # "modules_to_save", "lora" or "saved" (whole matrix outside modules_to_save)
    rank: int = 0
    scale: float = 0.0
    matrix: torch.Tensor | None = None
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None


def check_vocab_modules(
    found: Mapping[str, Mapping[str, tuple[int, ...]]],
    settings: LoraSettings,
    shape: ModelShape,
    max_lora_rank: int,
    deadline: float,
    scaling,
    served: bool,
) -> dict[str, VocabModule]:
    """module -> its VocabModule (no tensors), from the shapes of the tensors found per module and part;
    AdapterError naming the field or tensor for anything PEFT would not load or the server cannot serve.
    `scaling(settings, key, rank, deadline)` is PEFT's per-module LoRA scale. Unless `served` (the
    engine keeps room for them), an adapter with any of them is refused once its tensors' shapes passed."""
    saved = settings.modules_to_save
    vocab, hidden = shape.vocab_size, shape.hidden_size
    modules: dict[str, VocabModule] = {}
    for module, parts in found.items():
        lora_parts = {"A", "B", BASE} & set(parts)
        field = "modules_to_save" if module in saved else "target_modules" if lora_parts else None
        for part in (FULL, BASE):
            if part in parts:
                _check_matrix(module, part, parts[part], vocab, hidden, field)
        lora = {"A", "B"} & set(parts)
        if not lora:
            if BASE in parts:
                raise AdapterError(
                    "unexpected_tensor",
                    f"{module}.base_layer.weight is there without LoRA on {module}: PEFT saves the base "
                    "weights only beside a LoRA target; remove the tensor",
                    "target_modules",
                )
            kind = "modules_to_save" if module in saved else "saved"
            modules[module] = VocabModule(kind)
            continue
        if FULL in parts:
            raise AdapterError(
                "unsupported_target",
                f"{module} has both a whole matrix ({module}.weight) and LoRA weights: list it in "
                "modules_to_save or in target_modules, not both",
                field,
            )
        if lora != {"A", "B"}:
            raise AdapterError("incomplete_pair", f"{module}: its LoRA A and B must both be present")
        if settings.use_dora:
            raise AdapterError(
                "dora_unsupported",
                f"DoRA on {module} is not served; train with use_dora on the decoder projections only",
                "use_dora",
            )
        if settings.ensure_weight_tying and shape.tie_word_embeddings:
            raise AdapterError(
                "unsupported_target",
                f"LoRA on {module} with ensure_weight_tying on a model with tied embeddings is not served "
                "(PEFT shares one LoRA between the embedding and the head); train without ensure_weight_tying",
                "ensure_weight_tying",
            )
        key = VOCAB_MODULE_KEYS[module]
        if settings.targets is None or not settings.targets.names_vocab(key, deadline):
            raise AdapterError(
                "tensor_not_targeted",
                f"adapter_model.safetensors holds LoRA on {module}, but target_modules does not name it "
                f"({key}): PEFT would not apply those tensors; remove them or fix adapter_config.json",
                "target_modules",
            )
        a, b = parts["A"], parts["B"]
        rank = a[0] if len(a) == 2 else 0
        if module == "embed_tokens":  # lora_embedding_A [r, vocab], lora_embedding_B [hidden, r]
            names, expected = ("lora_embedding_A", "lora_embedding_B"), ((rank, vocab), (hidden, rank))
        else:  # lora_A [r, hidden], lora_B [vocab, r]
            names, expected = ("lora_A", "lora_B"), ((rank, hidden), (vocab, rank))
        if rank < 1 or (a, b) != expected:
            grown = module == "embed_tokens" and len(a) == 2 and a[1] > vocab
            grown |= module == "lm_head" and len(b) == 2 and b[0] > vocab
            if grown:
                raise _resized(module, field)
            raise AdapterError(
                "shape_mismatch",
                f"{module}: {names[0]} {list(a)} / {names[1]} {list(b)} do not fit the base model, which needs "
                f"{list(expected[0])} / {list(expected[1])} with rank >= 1; was the adapter trained on another "
                "model?",
                names[0],
            )
        if rank > max_lora_rank:
            raise AdapterError(
                "rank_too_large", f"{module} has rank {rank}, above max_lora_rank {max_lora_rank}"
            )
        if BASE not in parts and rank * (vocab + hidden) > vocab * hidden:
            raise AdapterError(
                "rank_too_large",
                f"{module} has LoRA of rank {rank} without its base layer saved: the server merges such LoRA "
                f"into a [{vocab}, {hidden}] matrix and keeps its factors there until then, which holds rank "
                f"{vocab * hidden // (vocab + hidden)} at most; save the adapter with PEFT's default "
                "save_embedding_layers",
                "target_modules",
            )
        configured = settings.rank_for(key, deadline)
        if rank != configured:
            raise AdapterError(
                "rank_mismatch",
                f"{module} has rank {rank} in adapter_model.safetensors, but adapter_config.json gives it "
                f"rank {configured}; PEFT refuses to load such an adapter",
                "r" if configured == settings.rank else "rank_pattern",
            )
        modules[module] = VocabModule("lora", rank, scaling(settings, key, rank, deadline))
    if (modules or saved) and not served:
        raise vocab_modules_refusal(modules, saved)
    for module in saved:
        if module not in found or FULL not in found[module]:
            raise AdapterError(
                "missing_tensor",
                f"modules_to_save names {module}, but adapter_model.safetensors holds no {module}.weight "
                "(PeftModel.save_pretrained saves it)",
                "modules_to_save",
            )
    return modules


def _check_matrix(module: str, part: str, got: tuple[int, ...], vocab: int, hidden: int, field: str) -> None:
    name = f"{module}.base_layer.weight" if part == BASE else f"{module}.weight"
    if len(got) == 2 and got[1] == hidden and got[0] > vocab:
        raise _resized(module, field, got[0], vocab)
    if tuple(got) != (vocab, hidden):
        raise AdapterError(
            "shape_mismatch",
            f"{name} has shape {list(got)}, but the base model's {module} is [{vocab}, {hidden}]; was the "
            "adapter trained on another model?",
            field,
        )


def _resized(
    module: str, field: str | None, rows: int | None = None, vocab: int | None = None
) -> AdapterError:
    sizes = f" has {rows} rows where the base vocabulary has {vocab}" if rows is not None else " is larger"
    return AdapterError(
        "vocab_resized",
        f"the adapter's {module}{sizes}: its tokenizer added tokens (resized embeddings), which this server "
        "cannot serve (requests are tokenized and detokenized with the base model's tokenizer); retrain "
        "without adding tokens, or serve the resized model as a base model of its own",
        field,
    )


def read_modules_to_save(value: tuple[str, ...] | None) -> tuple[str, ...]:
    """modules_to_save's vocabulary modules (a name or a dotted path ending in one); AdapterError naming
    any other module (a classifier head, a norm, ...), which the server does not serve."""
    if not value:
        return ()
    modules = []
    for entry in value:
        module = entry.rsplit(".", 1)[-1]
        if module not in VOCAB_MODULES:
            raise AdapterError(
                "modules_to_save_unsupported",
                f"modules_to_save names {show_value(entry)}: only embed_tokens and lm_head (the adapter's own "
                "embedding and LM head) are served",
                "modules_to_save",
            )
        if module not in modules:
            modules.append(module)
    return tuple(modules)


def ties_head_to_embedding(module: VocabModule, shape: ModelShape, ensure_weight_tying: bool) -> bool:
    """Whether an embed_tokens matrix of a tied model also serves as the head (see the module's doc)."""
    return shape.tie_word_embeddings and (module.kind == "saved" or ensure_weight_tying)


def vocab_modules_refusal(modules: Mapping[str, VocabModule], saved: tuple[str, ...]) -> AdapterError:
    """Why an adapter with its own embedding or LM head is refused by a server without room for them.
    With modules_to_save, in vLLM's words too (clients of its dynamic LoRA loading match them)."""
    named = [f"{m} ({v.kind})" for m, v in modules.items()] or [f"{m} (modules_to_save)" for m in saved]
    if saved:
        field = "modules_to_save"
    else:
        field = "target_modules" if any(v.kind == "lora" for v in modules.values()) else None
    vllm = " (this server only supports modules_to_save being None as started)" if saved else ""
    return AdapterError(
        "vocab_modules_unsupported",
        f"the adapter carries its own {', '.join(named)}: this server keeps no room for an adapter's own "
        f"embedding or LM head{vllm}; its operator can start it with --max-vocab-loras N (each such "
        "adapter resident takes 2 x vocab x hidden of GPU memory), or train on the decoder projections only",
        field,
    )
