"""adapter_config.json keys that decide whether PEFT would load the adapter as a causal-LM LoRA at all, or
would run it differently from a plain sum of low-rank products, which is all the engine computes.

- peft_type must be "LORA" exactly: PEFT looks the type up case-sensitively and refuses "lora".
- task_type must be "CAUSAL_LM" or absent: other tasks (SEQ_CLS, ...) are adapters for other heads, and
  PEFT refuses spellings outside its TaskType (such as "causal_lm").
- Features that change the forward pass are refused unless off (null, false, empty): the engine cannot
  serve them, and accepting them would answer differently from PEFT. Keys that only shape training
  (lora_dropout, init_lora_weights, loftq/eva/corda/lora_ga, velora_config, megatron_config) are accepted.
"""

from __future__ import annotations

from collections.abc import Mapping

from adapter_format.errors import AdapterError, show_value

CAUSAL_LM = "CAUSAL_LM"
# PEFT's TaskType values (peft.utils.peft_types.TaskType).
PEFT_TASK_TYPES = ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")

# key -> what it does that the engine does not; refused unless null, false or empty.
UNSERVABLE_FEATURES = {
    "layer_replication": "builds a new stack of base-model layers (layer_replication)",
    "alora_invocation_tokens": "activates the adapter only after its invocation tokens (Activated LoRA)",
    "use_qalora": "pools the input of each LoRA projection in groups (QALoRA)",
    "use_bdlora": "uses block-diagonal LoRA factors (BD-LoRA)",
    "kasa_config": "replaces singular values of the base weights (KaSA)",
    "monteclora_config": "samples the LoRA factors at run time (MonteCLoRA)",
    "arrow_config": "routes tokens between several LoRA experts (Arrow)",
    "trainable_token_indices": "trains embedding rows of chosen tokens (trainable tokens)",
    "target_parameters": "adapts raw parameters rather than linear projections (target_parameters)",
}


def check_peft_type(config: Mapping) -> None:
    peft_type = config.get("peft_type")
    if peft_type == "LORA":
        return
    hint = ""
    if isinstance(peft_type, str) and peft_type.upper() == "LORA":
        hint = ' (PEFT reads it case-sensitively and refuses this spelling: write "LORA")'
    raise AdapterError(
        "not_lora",
        f"peft_type is {show_value(peft_type)}; only LORA adapters are supported{hint}",
        "peft_type",
    )


def check_task_type(config: Mapping) -> None:
    task_type = config.get("task_type")
    if task_type is None or task_type == CAUSAL_LM:
        return
    if task_type in PEFT_TASK_TYPES:
        raise AdapterError(
            "task_type_unsupported",
            f"task_type is {task_type!r}: this adapter is for another kind of model head; only CAUSAL_LM "
            "adapters (text generation) can be served",
            "task_type",
        )
    raise AdapterError(
        "bad_config",
        f"adapter_config.json: task_type must be one of {', '.join(PEFT_TASK_TYPES)} or null, as PEFT "
        f"requires (got {show_value(task_type)}); only CAUSAL_LM adapters can be served",
        "task_type",
    )


def check_features(config: Mapping, allowed: tuple[str, ...] = ()) -> None:
    """`allowed`: keys the model serves after all (target_parameters on a mixture of experts)."""
    for key, what in UNSERVABLE_FEATURES.items():
        value = config.get(key)
        if key in allowed:
            continue
        if value is None or value is False or (isinstance(value, (list, dict, str)) and not value):
            continue
        raise AdapterError(
            "feature_unsupported",
            f"{key} is set ({show_value(value)}): this adapter {what}, which the server cannot run; "
            f"only plain LoRA adapters are supported (set {key} to null)",
            key,
        )
