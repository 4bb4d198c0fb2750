"""The values of an adapter's tensors: every one finite and within float16's range.

A NaN, an infinity or a value near float32's limit (3e38) in a LoRA factor turns every logit of every
request on that adapter into NaN or infinity: PEFT would serve it, as garbage, and the engine would answer
with empty text. Nothing trained holds such values, so they are refused when the adapter is uploaded and
again whenever it is loaded (an adapter stored before this check, or a local folder), naming the tensor.
The bound is float16's largest value: beyond it a factor overflows in half precision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from adapter_format.errors import AdapterError, show_value

MAX_ABS_WEIGHT = 65504.0  # torch.finfo(torch.float16).max


def check_weight_values(tensors: Mapping[str, torch.Tensor]) -> None:
    """AdapterError('bad_weight_values') naming the first tensor with a NaN, an infinity or a value beyond
    ±MAX_ABS_WEIGHT. One pass over each tensor (its minimum and maximum)."""
    for name, tensor in tensors.items():
        if tensor.numel() == 0:
            continue
        low, high = (float(v) for v in torch.aminmax(tensor))  # NaN anywhere makes both NaN
        if math.isnan(low) or math.isnan(high):
            problem = "holds NaN"
        elif math.isinf(low) or math.isinf(high):
            problem = "holds an infinite value"
        elif max(-low, high) > MAX_ABS_WEIGHT:
            problem = f"holds {high if high > -low else low:.3g}, beyond ±{MAX_ABS_WEIGHT:g}"
        else:
            continue
        raise AdapterError(
            "bad_weight_values",
            f"tensor {show_value(name)} of adapter_model.safetensors {problem}: no trained LoRA weight does, and "
            "serving it would turn every output into NaN; retrain or re-export the adapter",
        )
