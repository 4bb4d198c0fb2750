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
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's [E * r, in] and [out, r * E] -> per-expert A [E, r, in] and B [E, out, r] (views)."""
    rank = lora_a.shape[0] // num_experts
    a = lora_a.view(num_experts, rank, lora_a.shape[1])
    b = lora_b.view(lora_b.shape[0], rank, num_experts).permute(2, 0, 1)
    return a, b
