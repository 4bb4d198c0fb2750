"""Which class serves a checkpoint: `config.architectures[0]` (else `config.model_type`) looked up among the
`DecoderModel` subclasses of engine/model/architectures/, found by importing every module there.

It is also where the rest of the engine and the platform learn what an architecture means for adapters:
`model_shape(config)` gives the sizes and the LoRA targets (Phi-3: qkv_proj, o_proj, gate_up_proj,
down_proj; Llama-family: the seven separate projections) that adapter checks and the LoRA pool use.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import replace

from adapter_format.model_shape import ModelShape
from engine.model import architectures
from engine.model.layers.decoder import DecoderModel


@functools.cache
def _classes() -> tuple[dict[str, type[DecoderModel]], dict[str, type[DecoderModel]]]:
    """({architecture: class}, {model_type: class}) over every module of engine/model/architectures/."""
    by_architecture: dict[str, type[DecoderModel]] = {}
    by_model_type: dict[str, type[DecoderModel]] = {}
    for info in pkgutil.iter_modules(architectures.__path__):
        module = importlib.import_module(f"{architectures.__name__}.{info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, DecoderModel)
                and value.__module__ == module.__name__
            ):
                for name in value.architectures:
                    if name in by_architecture:
                        raise RuntimeError(f"{name} is served by both {by_architecture[name]} and {value}")
                    by_architecture[name] = value
                for name in value.model_types:
                    by_model_type[name] = value
    return by_architecture, by_model_type


def supported_architectures() -> list[str]:
    return sorted(_classes()[0])


def model_class(config) -> type[DecoderModel]:
    """The class for a Hugging Face config; ValueError naming what is supported otherwise."""
    by_architecture, by_model_type = _classes()
    names = getattr(config, "architectures", None) or []
    if names and names[0] in by_architecture:
        return by_architecture[names[0]]
    model_type = getattr(config, "model_type", None)
    if not names and model_type in by_model_type:
        return by_model_type[model_type]
    what = f"architecture {names[0]!r}" if names else f"model_type {model_type!r}"
    raise ValueError(
        f"{what} is not supported; supported architectures: {', '.join(supported_architectures())} "
        "(docs/MODELS.md)"
    )


def model_shape(config) -> ModelShape:
    """The model's sizes and its LoRA targets (what an adapter must fit)."""
    cls = model_class(config)
    names = getattr(config, "architectures", None) or [cls.architectures[0]]
    return replace(
        ModelShape.from_hf_config(config, cls.lora_targets(config)),
        architecture=names[0],
        dense_layers=cls.dense_layers(config),
        gate_up_interleaved=cls.gate_up_interleaved,
    )
