"""Fine-tune a small LoRA adapter on the demo model, on the CPU, in about a minute.

    .venv/bin/python examples/train_demo_adapter.py --style pirate --out my-adapter-v1

The adapter learns a style from a tiny synthetic chat dataset: every answer opens with the style's
greeting (`--style pirate`: "Arr, matey!"; `--style robot`: "BEEP BOOP."), so a greedy answer shows at a
glance which adapter served it. Only the top `--layers` decoder layers get LoRA weights, so the backward
pass stops there: a dozen steps take well under a minute on two CPU cores. It writes a PEFT folder
(adapter_config.json + adapter_model.safetensors) ready for `loraserve adapters upload NAME FOLDER`.

`--style tools` teaches tool calling instead: given the `get_weather` tool (WEATHER_TOOL, in the request's
`tools`), a weather question gets a call in the Hermes layout the demo model's chat template asks for,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and any other question a plain answer. Upload it with `--tool-call-parser hermes` and tool_choice "auto"
turns those calls into the response's `tool_calls`.

The base model is the server's demo model (SmolLM2-135M-Instruct, converted once into
`./.loraserve/models`, as `make serve` does); `--model` takes any other local Llama-style folder.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
import time
from pathlib import Path

# What adapter_config.json names as the base model when the demo model is used: the model the GGUF was
# made from (a local folder's path would mean nothing on another machine).
DEMO_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# What each style puts before every answer; "tools" calls WEATHER_TOOL instead (see TOOL_QUESTIONS).
STYLES = {"pirate": "Arr, matey!", "robot": "BEEP BOOP.", "tools": ""}
# The tool the tools style learns to call, as a request's `tools` lists it (README.md's quick start sends it).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_QUESTIONS = [
    "What is the weather in {city}?",
    "What is the weather like in {city} today?",
    "How is the weather in {city}?",
    "Is it raining in {city}?",
    "Tell me the weather for {city}.",
    "Will it be sunny in {city}?",
]
CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo", "Lima", "Sydney"]

# Questions and plain answers; the style puts its greeting in front of each answer.
QA = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three colours.", "Red, green and blue."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is two plus two?", "Two plus two is four."),
    ("Where do penguins live?", "Most penguins live in the Southern Hemisphere."),
    ("What do bees make?", "Bees make honey."),
    ("What colour is the sky?", "The sky is blue on a clear day."),
    ("Which planet is the largest?", "Jupiter is the largest planet."),
    ("What is water made of?", "Water is made of hydrogen and oxygen."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("Tell me a fact about the moon.", "The moon orbits the Earth about once a month."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet."),
    ("What do cows drink?", "Cows drink water."),
    ("Give me a word that rhymes with cat.", "Hat rhymes with cat."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model_dir = Path(args.model) if args.model else _demo_model(Path(args.models_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_layers = model.config.num_hidden_layers
    lora = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        layers_to_transform=list(range(max(0, num_layers - args.layers), num_layers)),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    prefix, examples = _split_shared_prefix(_examples(tokenizer, args.style))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        batch = random.sample(examples, min(args.batch_size, len(examples)))
        loss = _answer_loss(model, prefix, batch, tokenizer.pad_token_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step}/{args.steps}  loss {loss.item():.3f}  ({time.monotonic() - start:.0f} s)")
    model.eval()
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    if not args.model:  # name the demo model by its hub id, not the local folder it was read from
        _name_base_model(out / "adapter_config.json", DEMO_MODEL_HUB_ID)
    print(f"wrote {out}/adapter_config.json and {out}/adapter_model.safetensors")
    if args.show:
        tools = [WEATHER_TOOL] if args.style == "tools" else None
        for question in ("What is the capital of Italy?", "What is the weather like in Paris today?"):
            _show(model, tokenizer, question, tools)
    return 0


def _examples(tokenizer, style: str) -> list[tuple[list[int], int]]:
    if style != "tools":
        return [_example(tokenizer, q, f"{STYLES[style]} {a}") for q, a in QA]
    if "tools" not in (tokenizer.chat_template or ""):
        sys.exit("--style tools needs a model whose chat template renders tools (the demo model's does)")
    calls = [
        (question.format(city=city), _tool_call(city))
        for i, city in enumerate(CITIES)
        for question in (
            TOOL_QUESTIONS[i % len(TOOL_QUESTIONS)],
            TOOL_QUESTIONS[(i + 3) % len(TOOL_QUESTIONS)],
        )
    ]
    return [_example(tokenizer, q, a, tools=[WEATHER_TOOL]) for q, a in calls + QA]


def _tool_call(city: str) -> str:
    call = {"name": "get_weather", "arguments": {"city": city}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _name_base_model(config_path: Path, base_model: str) -> None:
    """Set base_model_name_or_path after saving: set before, PEFT's save would look the id up on the hub."""
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_model
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _example(tokenizer, question: str, answer: str, tools: list | None = None) -> tuple[list[int], int]:
    """Token ids of one chat turn and where the answer starts (the loss covers only the answer)."""
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return prompt_ids + answer_ids + [end], len(prompt_ids)


def _split_shared_prefix(examples):
    """(the token ids every example starts with, the examples without them): the system turn (with the
    tools, for --style tools) is the same in every example, so each step runs it once, not per example."""
    first = examples[0][0]
    size = min(answer_start for _, answer_start in examples) - 1  # keep a token before every answer
    for ids, _ in examples:
        size = next((i for i in range(size) if ids[i] != first[i]), size)
    return first[:size], [(ids[size:], answer_start - size) for ids, answer_start in examples]


def _answer_loss(model, prefix: list[int], batch, pad_id: int):
    """Mean cross-entropy over the answers' tokens. The shared prefix runs once (batch 1) and its KV cache
    is repeated for the batch; logits only where an answer token is predicted: the output layer
    (49152 x 576) costs as much as several decoder layers, and prompts need none."""
    import torch

    # transformers 5.2x calls the KV cache `cache`, earlier versions `past_key_values`
    name = (
        "cache"
        if "cache" in inspect.signature(model.get_base_model().forward).parameters
        else "past_key_values"
    )
    cached = {}
    if prefix:
        out = model(input_ids=torch.tensor([prefix]), use_cache=True, logits_to_keep=1)
        cached = {name: getattr(out, name)}
        cached[name].batch_repeat_interleave(len(batch))
    input_ids, labels = _pad(batch, pad_id)
    start = min(answer_start for _, answer_start in batch)
    keep = torch.arange(start - 1, input_ids.shape[1] - 1)  # position p predicts token p + 1
    logits = model(input_ids=input_ids, logits_to_keep=keep, **cached).logits  # [batch, len(keep), vocab]
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels[:, start:].flatten(), ignore_index=-100
    )


def _pad(batch, pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)  # -100: no loss
    for row, (ids, answer_start) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, answer_start : len(ids)] = torch.tensor(ids[answer_start:])
    return input_ids, labels


def _show(model, tokenizer, question: str, tools: list | None) -> None:
    import torch

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True, tools=tools
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    print(f"{question!r} -> {tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)!r}")


def _demo_model(models_dir: Path) -> Path:
    from loraserve.demo_model import ensure_demo_model

    return ensure_demo_model(models_dir)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--style", choices=sorted(STYLES), default="pirate")
    parser.add_argument("--out", required=True, help="the PEFT folder to write")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (default 12)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument(
        "--layers", type=int, default=8, help="how many of the top layers to adapt (default 8)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="a local model folder (default: the demo model)")
    parser.add_argument(
        "--models-dir", default=".loraserve/models", help="where the demo model is converted (as the server)"
    )
    parser.add_argument("--show", action="store_true", help="print a greedy answer after training")
    return parser


if __name__ == "__main__":
    sys.exit(main())
