"""LoRA on a mixture of experts' stacked expert weights, as PEFT saves it with `target_parameters`.

PEFT (0.17+) adapts a stacked parameter such as `mlp.experts.gate_up_proj` [E, 2I, H] with one
`ParamWrapper` holding every expert's pair in two matrices, and nests a second wrapper for a second
parameter of the same module, so the tensor names say only how deep the wrapper sits:

    ...layers.3.mlp.experts.lora_A.weight              [E * r, in]   (the outer wrapper)
    ...layers.3.mlp.experts.base_layer.lora_A.weight   [E * r, in]   (the inner one)

Which parameter each adapts follows from the shapes (in H and out 2I for gate_up_proj, in I and out H for
down_proj), never from the nesting order. PEFT's update of expert e is `scaling * B_e @ A_e` with
A_e = A.view(E, r, in)[e] and B_e = B.view(out, r, E)[:, :, e]: A's rows are expert-major, B's columns
rank-major. `expert_pair` turns them into [E, r, in] and [E, out, r].
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from adapter_format.errors import AdapterError, show_value
from adapter_format.model_shape import EXPERT_MODULES, ModelShape, module_key

EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.mlp\.experts(?P<nest>(?:\.base_layer)*)\.lora_(?P<ab>[AB])\.weight$"
)
MAX_TARGET_PARAMETERS = 64


def read_target_parameters(config: Mapping, shape: ModelShape | None) -> tuple[str, ...]:
    """The expert modules `target_parameters` names, in the model's target order; () when unset. A
    name that matches no stacked expert weight of this model is refused, naming it."""
    value = config.get("target_parameters")
    if value is None or value == []:
        return ()
    if not (
        isinstance(value, list)
        and len(value) <= MAX_TARGET_PARAMETERS
        and all(isinstance(v, str) and 0 < len(v) <= 256 for v in value)
    ):
        raise AdapterError(
            "bad_config",
            f"adapter_config.json: target_parameters must be a list of parameter names (got {show_value(value)})",
            "target_parameters",
        )
    targets = shape.targets if shape is not None else ()
    experts = [m for m in EXPERT_MODULES if m in targets]
    named = set()
    for entry in value:
        # PEFT's match: the parameter's full name equals the entry or ends with "." + entry.
        hits = [m for m in experts if _matches(module_key(0, m), entry)]
        if not hits:
            supported = ", ".join(f"mlp.{m}" for m in experts) or "none (not a mixture of experts)"
            raise AdapterError(
                "unsupported_target",
                f"target_parameters names {show_value(entry)}; the parameters LoRA may target on "
                f"{shape.model_name if shape else 'the base model'} are: {supported}",
                "target_parameters",
            )
        named.update(hits)
    return tuple(m for m in experts if m in named)


def _matches(key: str, entry: str) -> bool:
    return key == entry or key.endswith(f".{entry}")


def expert_module(shape: ModelShape, a_shape: tuple[int, ...], b_shape: tuple[int, ...], where: str) -> str:
    """Which stacked expert weight a wrapper's pair adapts, from its shapes; AdapterError if none fits."""
    experts = shape.num_experts
    for module in EXPERT_MODULES:
        if module not in shape.targets:
            continue
        in_features, out_features = shape.module_dims(module)
        if (
            len(a_shape) == 2
            and len(b_shape) == 2
            and a_shape[1] == in_features
            and b_shape[0] == out_features
            and a_shape[0] == b_shape[1]
            and a_shape[0] % experts == 0
            and a_shape[0] >= experts
        ):
            return module
    dims = {m: shape.module_dims(m) for m in EXPERT_MODULES if m in shape.targets}
    raise AdapterError(
        "shape_mismatch",
        f"{where}: lora_A {list(a_shape)} / lora_B {list(b_shape)} fit no stacked expert weight of the base "
        f"model ({', '.join(f'{m}: [{experts} * r, {i}] / [{o}, {experts} * r]' for m, (i, o) in dims.items())}); "
        "was the adapter trained on another model?",
    )


def expert_pair(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's [E * r, in] and [out, r * E] -> per-expert A [E, r, in] and B [E, out, r] (views). With
    `interleaved` (gpt-oss's gate_up_proj: out rows alternate gate and up) B's rows are reordered to
    every gate row, then every up row, as the engine's stacked weight holds them (a copy)."""
    rank = lora_a.shape[0] // num_experts
    a = lora_a.view(num_experts, rank, lora_a.shape[1])
    b = lora_b.view(lora_b.shape[0], rank, num_experts).permute(2, 0, 1)
    if interleaved:
        b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
    return a, b


# -- per-expert target_modules (PEFT on transformers 4, whose experts were separate Linear modules) -----
#
#   ...layers.3.mlp.experts.5.gate_proj.lora_A.weight [r, H]   (Mixtral: block_sparse_moe.experts.5.w1)
#
# Expert e's gate and up pairs fold into one pair of the stacked gate_up_proj, block-diagonally (rank
# r_gate + r_up): A = [A_gate; A_up], B = [[B_gate, 0], [0, B_up]], exact; down's pair is down_proj's.

PER_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<part>\w+?)\.lora_(?P<ab>[AB])\.weight$"
)
# An expert's projections by their names (Qwen's; Mixtral's w1, w3, w2): 0 gate, 1 up, 2 down.
EXPERT_PART_NAMES = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}


def part_module(part: str) -> str:
    return "experts.down_proj" if EXPERT_PART_NAMES[part] == 2 else "experts.gate_up_proj"


def fold_per_expert(
    tensors: dict[tuple[int, int, str], dict[str, torch.Tensor]], shape: ModelShape, ranks: dict
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, expert, part): {"A", "B"}} -> {(layer, module): (A [E, R, in], B [E, out, R])}, R the
    folded rank `ranks[(layer, module)]` (experts without a pair, and ranks past an expert's, zero)."""
    inter, experts = shape.moe_intermediate_size, shape.num_experts
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), rank in ranks.items():
        in_features, out_features = shape.module_dims(module)
        dtype = next(iter(tensors.values()))["A"].dtype
        out[(layer, module)] = (
            torch.zeros(experts, rank, in_features, dtype=dtype),
            torch.zeros(experts, out_features, rank, dtype=dtype),
        )
    used: dict[tuple[int, int], int] = {}  # (layer, expert) -> gate_up ranks filled so far
    for (layer, expert, part), ab in sorted(
        tensors.items(), key=lambda kv: (kv[0][0], kv[0][1], EXPERT_PART_NAMES[kv[0][2]])
    ):
        which = EXPERT_PART_NAMES[part]
        a, b = out[(layer, part_module(part))]
        r = ab["A"].shape[0]
        if which == 2:
            a[expert, :r], b[expert, :, :r] = ab["A"], ab["B"]
            continue
        first = used.get((layer, expert), 0)
        used[(layer, expert)] = first + r
        a[expert, first : first + r] = ab["A"]
        b[expert, which * inter : (which + 1) * inter, first : first + r] = ab["B"]
    return out


def check_per_expert(
    pairs: dict[tuple[int, str, int, str], dict[str, tuple[int, ...]]],
    shape: ModelShape,
    settings,
    max_lora_rank: int,
    deadline: float,
) -> dict[tuple[int, str], tuple[int, float]]:
    """Validate per-expert pairs {(layer, block, expert, part): {"A", "B": shape}} as PEFT would load them;
    {(layer, stacked module): (folded rank, scale)}. Gate and up of a layer's experts fold into one
    pair, so their scalings must agree (they do unless alpha_pattern or rank_pattern tell them apart)."""
    h, inter = shape.hidden_size, shape.moe_intermediate_size
    ranks: dict[tuple[int, str], int] = {}
    scales: dict[tuple[int, str], float] = {}
    filled: dict[tuple[int, int], int] = {}
    for (layer, block, expert, part), ab in sorted(pairs.items()):
        where = f"layer {layer} expert {expert} {part}"
        if set(ab) != {"A", "B"}:
            raise AdapterError("incomplete_pair", f"{where}: lora_A and lora_B must both be present")
        if layer >= shape.num_layers or expert >= shape.num_experts:
            raise AdapterError(
                "layer_out_of_range",
                f"{where}: the base model has {shape.num_layers} layers of {shape.num_experts} experts",
            )
        misplaced = shape.layer_refusal(layer, "experts.down_proj")  # a dense layer has no experts
        if misplaced is not None:
            raise AdapterError("unsupported_target", f"{where}: {misplaced}")
        down = EXPERT_PART_NAMES[part] == 2
        in_features, out_features = (inter, h) if down else (h, inter)
        rank = ab["A"][0] if len(ab["A"]) == 2 else 0
        if rank < 1 or ab["A"] != (rank, in_features) or ab["B"] != (out_features, rank):
            raise AdapterError(
                "shape_mismatch",
                f"{where}: lora_A {list(ab['A'])} / lora_B {list(ab['B'])} do not fit the base model's expert, "
                f"which needs [r, {in_features}] / [{out_features}, r]",
            )
        key = f"model.layers.{layer}.{block}.experts.{expert}.{part}"
        refusal = settings.targets.refusal(layer, part, deadline, key) if settings.targets else None
        if refusal is not None:
            raise AdapterError(
                "tensor_not_targeted",
                f"adapter_model.safetensors holds {where}, but {refusal[1]} ({key}): PEFT would not apply "
                "those tensors",
                refusal[0],
            )
        configured = settings.rank_for(key, deadline)
        if rank != configured:
            raise AdapterError(
                "rank_mismatch",
                f"{where} has rank {rank}, but adapter_config.json gives it rank {configured}; PEFT refuses "
                "to load such an adapter",
                "r" if configured == settings.rank else "rank_pattern",
            )
        alpha = settings.alpha_for(key, deadline)
        scale = alpha / (math.sqrt(rank) if settings.use_rslora else rank)
        module = part_module(part)
        if scales.setdefault((layer, module), scale) != scale:
            raise AdapterError(
                "feature_unsupported",
                f"{where}: its scaling {scale:g} differs from other {module} pairs of layer {layer} "
                f"({scales[(layer, module)]:g}); per-expert adapters are served with one scaling per layer "
                "for gate/up and one for down",
                "alpha_pattern",
            )
        total = rank if down else filled.get((layer, expert), 0) + rank
        if not down:
            filled[(layer, expert)] = total
        ranks[(layer, module)] = max(ranks.get((layer, module), 0), total)
    for (layer, module), rank in ranks.items():
        if rank > max_lora_rank:
            raise AdapterError(
                "rank_too_large",
                f"layer {layer}: the experts' gate_proj and up_proj pairs fold into one {module} pair of rank "
                f"{rank} (their ranks added), above max_lora_rank {max_lora_rank}; start the server with "
                f"--max-lora-rank {rank} or more",
                "r",
            )
    return {key: (rank, scales[key]) for key, rank in ranks.items()}
