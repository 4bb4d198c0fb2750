"""Merge several LoRA adapters into one, as PEFT's `LoraModel.add_weighted_adapter` does.

Methods (LoRAX's and PEFT's names): `linear`, `ties`, `dare_linear`, `dare_ties` (PEFT's
`_generalized_task_arithmetic_weighted_adapter`: lora_A and lora_B are merged separately, each part
weighted by sqrt(|weight * scaling|), the sign on A's side only), and `cat` (the parts' ranks stacked:
A_i scaled by weight * scaling, B_i as is; exact, rank = the sum of ranks). The merged adapter has
r = lora_alpha = its rank (PEFT's rule), so its own scaling is 1 (sqrt(r) when the first part uses
rsLoRA, which PEFT copies into the merged config). The pruning and sign election are PEFT's own
functions (`peft.utils.merge_utils`); only DARE's random masks are drawn here, from a generator seeded
by the caller (PEFT draws them from torch's global generator), in PEFT's order: module by module in the
model's order (layers ascending, projections in the model's order), for each module lora_A's masks
part by part, then lora_B's. So torch's global generator seeded with `seed` where PEFT starts drawing
(after `add_weighted_adapter` has initialised the new adapter's weights, which draws too) gives PEFT
the same masks (tests/engine/test_merged_adapters.py), and the same request always gets the same
merged adapter.

Refused (MergeError naming the problem): ranks a method cannot combine (PEFT's rule: equal ranks
except for `cat`; `cat` up to `max_lora_rank`), DoRA parts, modules_to_save, LoRA on the routed experts
(`target_parameters`: PEFT refuses them too), parts trained on different base models.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from peft.utils.merge_utils import calculate_majority_sign_mask, disjoint_merge, task_arithmetic, ties
from safetensors.torch import save_file

from adapter_format.checkpoint import PeftAdapter, load_peft_adapter
from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapter_format.model_shape import EXPERT_MODULES, ModelShape, module_key
from adapter_format.peft_config import read_adapter_config

MERGE_METHODS = ("linear", "ties", "dare_linear", "dare_ties", "cat")
DENSITY_METHODS = ("ties", "dare_linear", "dare_ties")  # the methods that prune (and need `density`)
SIGN_METHODS = ("ties", "dare_ties")  # the methods that elect a sign (`majority_sign_method`)
MAJORITY_SIGN_METHODS = ("total", "frequency")


class MergeError(ValueError):
    """Parts that cannot be merged as asked; the message says which and why (the API's 400)."""


@dataclass(frozen=True)
class MergeMethod:
    """How to merge: PEFT's `combination_type`, `density` and `majority_sign_method`."""

    method: str = "linear"
    density: float | None = None  # the fraction of each part's entries kept (ties and dare only)
    majority_sign_method: str = "total"


@dataclass(frozen=True)
class MergePart:
    """One adapter to merge: its loaded weights and the adapter_config.json fields PEFT's merge reads."""

    label: str  # how messages name it (`name@version`)
    adapter: PeftAdapter
    config: Mapping  # its adapter_config.json
    weight: float


def load_part(
    folder: str | Path, label: str, weight: float, shape: ModelShape, max_lora_rank: int
) -> MergePart:
    """Read and validate one part's PEFT folder (AdapterError if the server could not serve it alone)."""
    adapter = load_peft_adapter(folder, shape, max_lora_rank, label=label)
    return MergePart(label, adapter, read_adapter_config(folder), weight)


def merge_seed(spec_key: str) -> int:
    """DARE's seed for a merge: the first 63 bits of the sha256 of the merge's canonical description
    (parts as name@version, weights, method, density, sign method), so one spec gives one adapter."""
    return int.from_bytes(hashlib.sha256(spec_key.encode()).digest()[:8], "big") >> 1


def peft_rank(config: Mapping) -> int:
    """The rank PEFT allocates for an adapter: r, or the largest of rank_pattern's if larger."""
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def check_parts(parts: Sequence[MergePart], method: MergeMethod, max_lora_rank: int) -> int:
    """Refuse what PEFT cannot merge (or this server cannot serve); the merged adapter's rank."""
    if not parts:
        raise MergeError("a merge needs at least one adapter")
    for part in parts:
        config = part.config
        if part.adapter.use_dora or config.get("use_dora"):
            raise MergeError(f"{part.label} is a DoRA adapter; merges combine plain LoRA adapters only")
        if config.get("modules_to_save"):
            raise MergeError(
                f"{part.label} has modules_to_save; merges combine LoRA pairs only (PEFT cannot merge "
                "full modules either)"
            )
        targets = config.get("target_modules") or ()
        if any(name in str(targets) for name in ("embed_tokens", "lm_head")):
            raise MergeError(
                f"{part.label} has LoRA on embed_tokens or lm_head; merges combine the decoder projections' "
                "LoRA pairs only"
            )
        if config.get("target_parameters") or any(m in EXPERT_MODULES for _, m in part.adapter.modules):
            raise MergeError(
                f"{part.label} adapts the routed experts (target_parameters), which PEFT's "
                "add_weighted_adapter does not merge"
            )
    bases = {p.config.get("base_model_name_or_path") for p in parts} - {None, ""}
    if len(bases) > 1:
        labels = ", ".join(f"{p.label} ({p.config.get('base_model_name_or_path')!r})" for p in parts)
        raise MergeError(f"the adapters were trained on different base models: {labels}")
    ranks = [peft_rank(p.config) for p in parts]
    if method.method == "cat":
        rank = sum(ranks)
        if rank > max_lora_rank:
            raise MergeError(
                f"a cat merge has the sum of the ranks ({' + '.join(map(str, ranks))} = {rank}), above "
                f"this server's max_lora_rank {max_lora_rank}; merge fewer adapters or use linear"
            )
        return rank
    if len(parts) > 1 and len(set(ranks)) != 1:
        labels = ", ".join(f"{p.label} (r={r})" for p, r in zip(parts, ranks))
        raise MergeError(
            f"{method.method} merges adapters of one rank only (as PEFT's add_weighted_adapter): {labels}; "
            "use cat to stack adapters of different ranks"
        )
    for key in sorted({k for p in parts for k in p.adapter.modules}):
        module_ranks = {p.adapter.modules[key].rank for p in parts if key in p.adapter.modules}
        if len(module_ranks) > 1:
            raise MergeError(
                f"layer {key[0]} {key[1]} has ranks {sorted(module_ranks)} in the adapters (rank_pattern); "
                f"{method.method} needs one rank per module"
            )
    return ranks[0]


def merge_adapters(
    parts: Sequence[MergePart], method: MergeMethod, shape: ModelShape, max_lora_rank: int, seed: int
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The merged adapter as PEFT saves one: (adapter_config.json's dict, its float32 tensors)."""
    rank = check_parts(parts, method, max_lora_rank)
    unknown = sorted({m for p in parts for _, m in p.adapter.modules} - set(shape.targets))
    if unknown:
        raise MergeError(
            f"merges combine LoRA on {', '.join(shape.targets)} only, not on {', '.join(unknown)}"
        )
    combination = "linear" if len(parts) == 1 else method.method  # PEFT's rule for a single adapter
    generator = torch.Generator().manual_seed(seed)  # DARE's masks, in PEFT's order (module docstring)
    keys = sorted(
        {k for p in parts for k in p.adapter.modules}, key=lambda k: (k[0], shape.targets.index(k[1]))
    )
    tensors: dict[str, torch.Tensor] = {}
    for key in keys:
        present = [p for p in parts if key in p.adapter.modules]
        modules = [p.adapter.modules[key] for p in present]
        a_parts = [m.lora_a.to(torch.float32) for m in modules]  # [r, in] each
        b_parts = [m.lora_b.to(torch.float32) for m in modules]  # [out, r] each
        scaled = [p.weight * m.scale for p, m in zip(present, modules)]
        if combination == "cat":
            lora_a = torch.cat([a * s for a, s in zip(a_parts, scaled)], dim=0)  # [sum r, in]
            lora_b = torch.cat(b_parts, dim=1)  # [out, sum r]
        else:
            # the sign on A's side only, so a negative weight is not cancelled by B's
            weights_a = torch.tensor([math.sqrt(abs(s)) * (1 if s >= 0 else -1) for s in scaled])
            weights_b = torch.tensor([math.sqrt(abs(s)) for s in scaled])
            lora_a = _combine(combination, a_parts, weights_a, method, generator)
            lora_b = _combine(combination, b_parts, weights_b, method, generator)
        # Padded to the merged rank with zeros, which change nothing: PEFT gives every module r = rank.
        lora_a = torch.nn.functional.pad(lora_a, (0, 0, 0, rank - lora_a.shape[0]))
        lora_b = torch.nn.functional.pad(lora_b, (0, rank - lora_b.shape[1]))
        prefix = f"base_model.model.{module_key(*key)}"
        tensors[f"{prefix}.lora_A.weight"] = lora_a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = lora_b.contiguous()
    first = parts[0].config
    targets = sorted({m for p in parts for _, m in p.adapter.modules}, key=shape.targets.index)
    config = {
        "peft_type": "LORA",
        "task_type": first.get("task_type", "CAUSAL_LM"),
        "base_model_name_or_path": first.get("base_model_name_or_path"),
        "r": rank,
        "lora_alpha": rank,
        "use_rslora": bool(first.get("use_rslora", False)),  # PEFT copies the first part's config
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "lora_dropout": 0.0,
    }
    return config, tensors


def _combine(
    combination: str,
    tensors: list[torch.Tensor],
    weights: torch.Tensor,
    method: MergeMethod,
    generator: torch.Generator,
) -> torch.Tensor:
    """One side (all A's or all B's) of one module, merged with PEFT's functions."""
    if combination == "linear":
        return task_arithmetic(tensors, weights)
    density = method.density
    if combination == "ties":
        return ties(tensors, weights, density, method.majority_sign_method)
    # DARE: PEFT's random_pruning (bernoulli keep mask, rescaled by 1 / density) with our generator
    if density < 1:
        tensors = [
            t * torch.bernoulli(torch.full_like(t, density), generator=generator) / density for t in tensors
        ]
    if combination == "dare_linear":
        return task_arithmetic(tensors, weights)
    stacked = torch.stack(tensors, dim=0)  # [parts, ...]
    signs = calculate_majority_sign_mask(stacked, method=method.majority_sign_method)
    return disjoint_merge(stacked * weights.view(-1, *([1] * (stacked.dim() - 1))), signs)


def write_merged_folder(folder: Path, config: dict, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write a merged adapter as a PEFT folder (adapter_config.json + adapter_model.safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    save_file(dict(tensors), str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
