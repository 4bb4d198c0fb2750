"""The LoRA adapter file format, shared by the engine and the adapter store: one place for each rule.

- `files`: the file names (adapter_config.json, adapter_model.safetensors).
- `peft_config`: adapter_config.json, read with bounded nesting, every key the engine relies on checked.
- `safetensors_header`: tensor names and shapes from a safetensors header, strictly checked, no data read.
- `model_shape`: the base model's projection sizes that an adapter's tensors must fit.
- `checkpoint`: the checks on names and shapes (`check_adapter`) and the loader (`load_peft_adapter`).
- `errors`: AdapterError, the one error type for an adapter that cannot be served; InvalidName.
- `names`: names, versions, `name@version` references and engine adapter ids (`tenant/name@version`,
  `tenant/merge+<key>`): their syntax, parsing and formatting, here and nowhere else.
- `events`: the load events (hits, misses, load times) the engine and the store report.

It imports neither the engine nor the store, so each may use it without importing the other.
"""
