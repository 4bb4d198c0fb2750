"""Read and validate PEFT LoRA checkpoints (adapter_config.json + adapter_model.safetensors).

Validation of names and shapes works on them alone (`check_adapter`, fed by safetensors_header.py), so the
adapter store runs it on a safetensors header before it writes the weights; `load_peft_adapter` runs the
same checks, then reads the tensors, and `map_peft_adapter` runs them, then maps the file; both then check
the tensors' values (weight_values.py), which the store does too, on the staged file, before it stores it.
Only safetensors is read: pickled `.bin` checkpoints are refused, never unpickled.
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open

from adapter_format.errors import AdapterError, show_value
from adapter_format.expert_lora import (
    EXPERT_PART_NAMES,
    EXPERT_TENSOR,
    PER_EXPERT_TENSOR,
    check_per_expert,
    expert_module,
    expert_pair,
    fold_per_expert,
)
from adapter_format.files import WEIGHTS_FILE
from adapter_format.model_shape import EXPERT_MODULES, ModelShape, module_key
from adapter_format.module_patterns import new_deadline
from adapter_format.peft_config import (
    LoraSettings,
    check_adapter_config,
    parse_adapter_config,
    read_adapter_config,
)
from adapter_format.safetensors_header import (
    DTYPE_BYTES,
    TensorSpan,
    buffer_tensor_spans,
    read_tensor_spans,
)
from adapter_format.vocab_modules import (
    BASE,
    FULL,
    VOCAB_MODULES,
    VocabModule,
    check_vocab_modules,
    vocab_tensor,
)
from adapter_format.weight_values import check_magnitude_values, check_weight_values

# e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (any prefix before `layers.`), and
# DoRA's magnitude vector, `...q_proj.lora_magnitude_vector` (PEFT >= 0.12 may add `.weight`; it reads both).
# A shared expert's projections are `mlp.shared_expert.gate_proj` (module "shared_expert.gate_proj"; GLM-4.5's
# `mlp.shared_experts.gate_proj`, module "shared_experts.gate_proj").
_TENSOR_NAME = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>(?:shared_experts?\.)?\w+?)\."
    r"(?:lora_(?P<ab>[AB])\.weight|(?P<magnitude>lora_magnitude_vector)(?:\.weight)?)$"
)
MAGNITUDE = "M"  # a module's DoRA magnitude among its tensors (next to "A" and "B")


def _part(match: re.Match) -> str:
    return MAGNITUDE if match.groupdict().get("magnitude") else match["ab"]


# PEFT's names are under 100 characters; longer ones are refused before the pattern or int() see them.
MAX_TENSOR_NAME_CHARS = 512


@dataclass(frozen=True)
class ModuleLoRA:
    """One projection's low-rank pair in one layer."""

    rank: int
    scale: float  # PEFT's scaling: alpha / r, or alpha / sqrt(r) with use_rslora
    lora_a: torch.Tensor | None = None  # [rank, in]
    lora_b: torch.Tensor | None = None  # [out, rank]
    # DoRA (use_dora): the magnitude vector [out]; the output row n is scaled by
    # magnitude[n] / ||W[n] + scale * (B A)[n]|| (engine/lora/dora.py)
    magnitude: torch.Tensor | None = None


@dataclass(frozen=True)
class PeftAdapter:
    """A validated adapter: its config summary and its modules keyed by (layer, projection)."""

    rank: int  # the largest rank over its modules
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None
    modules: dict[tuple[int, str], ModuleLoRA]
    use_dora: bool = False
    # embed_tokens / lm_head: the adapter's own matrix or LoRA on it (adapter_format/vocab_modules.py)
    vocab: dict[str, VocabModule] = field(default_factory=dict)
    ensure_weight_tying: bool = False

    @property
    def format(self) -> str:
        """What `/v1/adapters` shows: "lora" or "dora"."""
        return "dora" if self.use_dora else "lora"

    @property
    def vocab_formats(self) -> dict[str, str]:
        """What `/v1/adapters` shows of its vocabulary modules: {"lm_head": "modules_to_save", ...}."""
        return {module: self.vocab[module].kind for module in VOCAB_MODULES if module in self.vocab}


def check_adapter(
    config: Mapping,
    tensor_shapes: Mapping[str, tuple[int, ...]],
    shape: ModelShape,
    max_lora_rank: int,
    vocab_modules_served: bool = False,
) -> PeftAdapter:
    """Validate a config and its tensors' names and shapes against the base model (no tensor data read).

    An adapter's own embedding or LM head (vocab_modules.py) is checked, then refused unless
    `vocab_modules_served` (the engine keeps room for them: EngineConfig.max_vocab_loras > 0)."""
    settings = check_adapter_config(config, max_lora_rank, shape)
    deadline = new_deadline()  # bounds all the pattern matching of this adapter
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    per_expert: dict[tuple[int, str, int, str], dict[str, tuple[int, ...]]] = {}  # older per-expert pairs
    prefixes: dict[str, str] = {}  # tensor name prefix -> the first tensor under it
    vocab_found: dict[str, dict[str, tuple[int, ...]]] = {}  # embed_tokens / lm_head -> part -> shape
    for name, tensor_shape in tensor_shapes.items():
        match = _TENSOR_NAME.match(name) if len(name) <= MAX_TENSOR_NAME_CHARS else None
        vocab = vocab_tensor(name) if match is None and len(name) <= MAX_TENSOR_NAME_CHARS else None
        if vocab is not None:
            module, part = vocab
            if part in vocab_found.setdefault(module, {}):
                raise AdapterError(
                    "duplicate_tensor", f"tensor {show_value(name)}: {module} {part} appears twice"
                )
            vocab_found[module][part] = tuple(tensor_shape)
            continue
        expert = _per_expert(name, shape) if match is None else None
        if expert is not None:
            key = (int(expert["layer"]), expert["block"], int(expert["expert"]), expert["part"])
            prefixes.setdefault(expert["prefix"], name)
            if len(prefixes) > 1 or expert["ab"] in per_expert.get(key, {}):
                raise AdapterError(
                    "duplicate_tensor", f"tensor {show_value(name)} appears twice or under another prefix"
                )
            per_expert.setdefault(key, {})[expert["ab"]] = tuple(tensor_shape)
            continue
        if match is None and shape.num_experts and len(name) <= MAX_TENSOR_NAME_CHARS:
            match = EXPERT_TENSOR.match(name)  # target_parameters on the stacked experts: (layer, nesting)
        if match is None:
            raise AdapterError(
                "unexpected_tensor",
                f"tensor {show_value(name)} is not a LoRA weight of a decoder-layer projection "
                f"({', '.join(shape.targets)}) or its DoRA magnitude, nor embed_tokens or lm_head as PEFT saves "
                "them (a whole matrix, LoRA, or the base layer beside LoRA); bias tensors are not supported",
            )
        layer, ab = int(match["layer"]), _part(match)
        module = match["module"] if "module" in match.groupdict() else f"experts{match['nest']}"
        if module not in shape.targets and not module.startswith("experts"):
            raise AdapterError(
                "unsupported_target",
                f"tensor {name!r} targets {module!r}; LoRA on {shape.model_name} may target "
                f"{', '.join(shape.targets)}{shape.unsupported_targets_hint([module])}",
            )
        if layer >= shape.num_layers:
            raise AdapterError(
                "layer_out_of_range",
                f"tensor {name!r} is for layer {layer}, but the base model has {shape.num_layers}",
            )
        misplaced = shape.layer_refusal(layer, module)
        if misplaced is not None:
            raise AdapterError("unsupported_target", f"tensor {show_value(name)}: {misplaced}")
        prefixes.setdefault(match["prefix"], name)
        if len(prefixes) > 1:
            first, other = prefixes.values()
            raise AdapterError(
                "duplicate_tensor",
                f"tensors {show_value(first)} and {show_value(name)} are under different prefixes; PEFT saves "
                "one model's LoRA weights under one prefix (a second copy would be ignored or replace the first)",
            )
        pair = pairs.setdefault((layer, module), {})
        if ab in pair:
            what = "lora_magnitude_vector" if ab == MAGNITUDE else f"lora_{ab}"
            raise AdapterError(
                "duplicate_tensor", f"layer {layer} {module}: {what} appears twice ({show_value(name)})"
            )
        pair[ab] = tuple(tensor_shape)
    if not pairs and not per_expert and not vocab_found:
        raise AdapterError("no_lora_weights", "adapter_model.safetensors holds no LoRA weights")
    vocab_modules = check_vocab_modules(
        vocab_found, settings, shape, max_lora_rank, deadline, _scaling, vocab_modules_served
    )
    if per_expert and settings.use_dora:
        raise _no_dora_on_experts()

    modules: dict[tuple[int, str], ModuleLoRA] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if not {"A", "B"} <= set(ab):
            raise AdapterError(
                "incomplete_pair", f"layer {layer} {module}: lora_A and lora_B must both be present"
            )
        if module.startswith("experts"):
            module = expert_module(shape, ab["A"], ab["B"], f"layer {layer} mlp.{module}")
            if (layer, module) in modules:
                raise AdapterError("duplicate_tensor", f"layer {layer} mlp.{module} is adapted twice")
            if settings.use_dora:
                raise _no_dora_on_experts()
            ab = {
                "A": (ab["A"][0] // shape.num_experts, ab["A"][1]),
                "B": (ab["B"][0], ab["B"][1] // shape.num_experts),
            }
        else:
            _check_magnitude(settings, layer, module, ab.get(MAGNITUDE), shape)
        in_features, out_features = shape.module_dims(module)
        rank = ab["A"][0] if len(ab["A"]) == 2 else 0
        if rank < 1:
            raise AdapterError(
                "shape_mismatch",
                f"layer {layer} {module}: lora_A has shape {list(ab['A'])}; it must be [rank, {in_features}] "
                "with rank >= 1",
            )
        expected_a, expected_b = (rank, in_features), (out_features, rank)
        if ab["A"] != expected_a or ab["B"] != expected_b:
            raise AdapterError(
                "shape_mismatch",
                f"layer {layer} {module}: lora_A {list(ab['A'])} / lora_B {list(ab['B'])} do not fit the base "
                f"model, which needs {list(expected_a)} / {list(expected_b)}; was the adapter trained on another model?",
            )
        if rank > max_lora_rank:
            raise AdapterError(
                "rank_too_large",
                f"layer {layer} {module} has rank {rank}, above max_lora_rank {max_lora_rank}",
            )
        key = module_key(layer, module)
        if module in EXPERT_MODULES:  # PEFT wraps the parameters target_parameters names, in every layer
            refusal = (
                None
                if module in settings.target_parameters
                else ("target_parameters", "target_parameters does not name it")
            )
        else:
            refusal = settings.targets.refusal(layer, module, deadline) if settings.targets else None
        if refusal is not None:
            field, why = refusal
            raise AdapterError(
                "tensor_not_targeted",
                f"adapter_model.safetensors holds layer {layer} {module}, but {why} ({key}): PEFT would not "
                "apply those tensors; remove them or fix adapter_config.json",
                field,
            )
        configured = settings.rank_for(key, deadline)
        if rank != configured:
            field = "r" if configured == settings.rank else "rank_pattern"
            raise AdapterError(
                "rank_mismatch",
                f"layer {layer} {module} has rank {rank} in adapter_model.safetensors, but adapter_config.json "
                f"gives it rank {configured} ({field}); PEFT refuses to load such an adapter",
                field,
            )
        modules[(layer, module)] = ModuleLoRA(rank=rank, scale=_scaling(settings, key, rank, deadline))
    for key, (rank, scale) in check_per_expert(per_expert, shape, settings, max_lora_rank, deadline).items():
        if key in modules:
            raise AdapterError(
                "duplicate_tensor", f"layer {key[0]} mlp.{key[1]} is adapted both per expert and as a whole"
            )
        modules[key] = ModuleLoRA(rank=rank, scale=scale)
    targets = tuple(sorted({module for _, module in modules}, key=shape.targets.index))
    targets += tuple(m for m in VOCAB_MODULES if m in vocab_modules and vocab_modules[m].kind == "lora")
    ranks = [m.rank for m in modules.values()] + [v.rank for v in vocab_modules.values() if v.rank]
    return PeftAdapter(
        rank=max(ranks, default=settings.rank),
        alpha=settings.alpha,
        target_modules=targets,
        base_model=settings.base_model,
        modules=modules,
        use_dora=settings.use_dora,
        vocab=vocab_modules,
        ensure_weight_tying=settings.ensure_weight_tying,
    )


def _no_dora_on_experts() -> AdapterError:
    return AdapterError(
        "dora_unsupported",
        "DoRA on a mixture of experts' expert weights is not served; train the expert adapter without use_dora",
        "use_dora",
    )


def _per_expert(name: str, shape: ModelShape):
    """The match of an older PEFT's per-expert tensor name (a mixture of experts only), else None."""
    if not shape.num_experts or len(name) > MAX_TENSOR_NAME_CHARS:
        return None
    match = PER_EXPERT_TENSOR.match(name)
    return match if match is not None and match["part"] in EXPERT_PART_NAMES else None


def _check_magnitude(
    settings: LoraSettings, layer: int, module: str, magnitude: tuple[int, ...] | None, shape: ModelShape
) -> None:
    """DoRA: each pair needs its magnitude vector [out] (PEFT would start a missing one at the base
    weight's norm and serve something else); without use_dora PEFT ignores a magnitude, so it is refused."""
    out_features = shape.module_dims(module)[1]
    if not settings.use_dora:
        if magnitude is not None:
            raise AdapterError(
                "unexpected_tensor",
                f"layer {layer} {module} has a lora_magnitude_vector (DoRA), but adapter_config.json does not "
                "set use_dora: PEFT would ignore it; set use_dora to true or remove the tensor",
                "use_dora",
            )
        return
    if magnitude is None:
        raise AdapterError(
            "missing_magnitude",
            f"layer {layer} {module}: use_dora is set but its lora_magnitude_vector is missing from "
            "adapter_model.safetensors (PeftModel.save_pretrained saves it)",
            "use_dora",
        )
    if magnitude != (out_features,):
        raise AdapterError(
            "shape_mismatch",
            f"layer {layer} {module}: lora_magnitude_vector has shape {list(magnitude)}, but the base model "
            f"needs [{out_features}] (one magnitude per output feature); was the adapter trained on another model?",
            "lora_magnitude_vector",
        )


def _scaling(settings: LoraSettings, key: str, rank: int, deadline: float) -> float:
    """PEFT's per-module scaling, honouring alpha_pattern and use_rslora."""
    alpha = settings.alpha_for(key, deadline)
    return alpha / math.sqrt(rank) if settings.use_rslora else alpha / rank


def load_peft_adapter(
    folder: str | Path,
    shape: ModelShape,
    max_lora_rank: int,
    label: str | None = None,
    vocab_modules_served: bool = False,
) -> PeftAdapter:
    """Read, validate and load a PEFT adapter folder onto the CPU (weights in their stored dtype).

    Messages name the weights file as `label` (default: its path). `vocab_modules_served`: as in
    `check_adapter`; with it, an embed_tokens / lm_head module comes with its tensors (VocabModule)."""
    weights, adapter, _ = _check_folder(folder, shape, max_lora_rank, label, vocab_modules_served)
    try:
        with safe_open(str(weights), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises several types for corrupt headers
        raise AdapterError(
            "bad_weights", f"{label or weights} is not a readable safetensors file: {exc}"
        ) from None
    return _with_tensors(adapter, tensors, shape)


def map_peft_adapter(
    folder: str | Path,
    shape: ModelShape,
    max_lora_rank: int,
    label: str | None = None,
    vocab_modules_served: bool = False,
) -> PeftAdapter:
    """`load_peft_adapter` without reading: the same checks, then tensors that are views of the weights
    file mapped into memory (copy-on-write, so writing to one never changes the file).

    For a caller that copies the weights elsewhere at once (a CPU-tier row): each byte is then read once,
    straight from the page cache, instead of into fresh tensors first (allocating those, one page fault
    per 4 KiB, cost more than the copy itself); the value check reads them once before. The mapping lives as long as any of its tensors. The
    file must not shrink while they are read (a read past its end is a SIGBUS, as it is inside
    `safe_open`, which maps the file too); a stored or cached file is never changed in place.
    """
    weights, adapter, spans = _check_folder(folder, shape, max_lora_rank, label, vocab_modules_served)
    try:
        with open(weights, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        tensors = {name: _view(mapped, span) for name, span in spans.items()}
    except (OSError, ValueError) as exc:  # changed since its header was read
        raise AdapterError(
            "bad_weights", f"{label or weights} is not a readable safetensors file: {exc}"
        ) from None
    return _with_tensors(adapter, tensors, shape)


def peft_adapter_from_memory(
    config: bytes,
    weights: bytes | bytearray | memoryview,
    shape: ModelShape,
    max_lora_rank: int,
    label: str = WEIGHTS_FILE,
    vocab_modules_served: bool = False,
) -> PeftAdapter:
    """`map_peft_adapter` of an adapter held in memory (a store download streamed without a temporary
    file): `config` is adapter_config.json's bytes, `weights` the safetensors file's. The same checks,
    then tensors that are views of `weights` (a bytearray: torch views only writable buffers without a
    warning; it must stay alive and unchanged while they are read). `label` names the weights in errors."""
    settings = parse_adapter_config(config)
    spans = buffer_tensor_spans(weights, label)
    shapes = {n: s.shape for n, s in spans.items()}
    adapter = check_adapter(settings, shapes, shape, max_lora_rank, vocab_modules_served)
    tensors = {name: _view(weights, span) for name, span in spans.items()}
    return _with_tensors(adapter, tensors, shape)  # the shape: expert pairs split (and de-interleaved)


# The torch dtype of each safetensors dtype the header check accepts (safetensors_header.DTYPE_BYTES).
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
assert _TORCH_DTYPES.keys() == DTYPE_BYTES.keys(), "a dtype the header accepts has no torch dtype here"


def _view(mapped: mmap.mmap | bytes | bytearray | memoryview, span: TensorSpan) -> torch.Tensor:
    dtype = _TORCH_DTYPES[span.dtype]
    if span.num_bytes == 0:
        return torch.empty(span.shape, dtype=dtype)
    count = span.num_bytes // dtype.itemsize
    return torch.frombuffer(mapped, dtype=dtype, count=count, offset=span.offset).view(span.shape)


def _check_folder(
    folder: str | Path,
    shape: ModelShape,
    max_lora_rank: int,
    label: str | None,
    vocab_modules_served: bool = False,
) -> tuple[Path, PeftAdapter, dict[str, TensorSpan]]:
    """The weights file, the adapter as its config and header describe it, and where its tensors lie."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError("not_found", f"adapter folder {folder} does not exist")
    config = read_adapter_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = [p.name for p in folder.glob("*.bin")]
        hint = (
            f" (found {pickled}: pickled checkpoints are never loaded; convert to safetensors)"
            if pickled
            else ""
        )
        raise AdapterError("missing_weights", f"{weights} does not exist{hint}")
    spans = read_tensor_spans(weights, label or str(weights))
    shapes = {name: span.shape for name, span in spans.items()}
    adapter = check_adapter(config, shapes, shape, max_lora_rank, vocab_modules_served)
    return weights, adapter, spans


def _with_tensors(
    adapter: PeftAdapter, tensors: Mapping[str, torch.Tensor], shape: ModelShape | None = None
) -> PeftAdapter:
    """The checked adapter with its tensors (as stored: the slot image converts them once), whose values
    are checked here, so every load checks them."""
    check_weight_values(tensors)
    loaded: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    per_expert: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}
    vocab: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if not _TENSOR_NAME.match(name) and (found := vocab_tensor(name)) is not None:
            vocab.setdefault(found[0], {})[found[1]] = tensor
            continue
        expert = _per_expert(name, shape) if shape is not None and not _TENSOR_NAME.match(name) else None
        if expert is not None:
            key = (int(expert["layer"]), int(expert["expert"]), expert["part"])
            per_expert.setdefault(key, {})[expert["ab"]] = tensor
            continue
        match = _TENSOR_NAME.match(name) or EXPERT_TENSOR.match(name)
        module = match["module"] if "module" in match.groupdict() else f"experts{match['nest']}"
        loaded.setdefault((int(match["layer"]), module), {})[_part(match)] = tensor
        if match.groupdict().get("magnitude"):
            check_magnitude_values(name, tensor)
    if shape is not None and shape.num_experts:  # wrappers by nesting -> stacked weights, per expert
        for layer, nested in [k for k in loaded if k[1].startswith("experts")]:
            ab = loaded.pop((layer, nested))
            module = expert_module(shape, tuple(ab["A"].shape), tuple(ab["B"].shape), nested)
            interleaved = shape.gate_up_interleaved and module == "experts.gate_up_proj"
            a, b = expert_pair(ab["A"], ab["B"], shape.num_experts, interleaved)
            loaded[(layer, module)] = {"A": a, "B": b}
    if per_expert:  # gate/up folded block-diagonally into the stacked pair, at the rank checked
        folded = {k: m.rank for k, m in adapter.modules.items() if k not in loaded}
        for key, (a, b) in fold_per_expert(per_expert, shape, folded).items():
            loaded[key] = {"A": a, "B": b}
    modules = {
        key: ModuleLoRA(
            rank=m.rank,
            scale=m.scale,
            lora_a=loaded[key]["A"],
            lora_b=loaded[key]["B"],
            magnitude=loaded[key].get(MAGNITUDE),
        )
        for key, m in adapter.modules.items()
    }
    return replace(
        adapter, modules=modules, vocab={m: _with_vocab(v, vocab[m], m) for m, v in adapter.vocab.items()}
    )


def _with_vocab(module: VocabModule, parts: dict[str, torch.Tensor], name: str) -> VocabModule:
    """The checked vocabulary module with its tensors: LoRA as one product `left @ right` [vocab, hidden]."""
    matrix = parts.get(FULL, parts.get(BASE))
    if module.kind != "lora":
        return replace(module, matrix=matrix)
    a, b = parts["A"], parts["B"]
    left, right = (a.T, b.T) if name == "embed_tokens" else (b, a)
    return replace(module, matrix=matrix, left=left, right=right)
