"""`loraserve serve` flags: vLLM names, LORASERVE_* environment defaults (flags win), validation, and the
idempotent `--lora-modules` preload."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from app_fixtures import make_text_model
from factories import make_adapter
from loraserve.bootstrap import engine_config, open_services, preload_lora_modules, sweep_quietly
from loraserve.cli import build_parser, settings_from_args
from loraserve.name_conflicts import NameConflict
from loraserve.settings import ServerSettings

from adapters_store import StoreConfig, StoreUnavailable, open_store
from engine import ModelShape
from engine.engine_args import SCHEDULING_POLICIES, EngineArgs, flag_name, flag_of
from engine.model.loader import load_config


def settings(argv, env=None):
    return settings_from_args(build_parser(env or {}).parse_args(["serve", *argv]))


def test_defaults_flags_and_environment(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    default = settings([])
    assert (default.port, default.max_loras, default.shutdown_timeout, default.model) == (8000, 4, 30.0, None)
    assert default.enable_prefix_caching and default.max_concurrent_requests_per_tenant is None
    env = {
        "LORASERVE_MAX_LORAS": "7",
        "LORASERVE_ENABLE_PREFIX_CACHING": "false",
        "LORASERVE_PORT": "9001",
        "LORASERVE_LORA_MODULES": f"a={tmp_path / 'a'}, b={tmp_path / 'b'}",
        "LORASERVE_SHUTDOWN_TIMEOUT": "5",
        "LORASERVE_MAX_CONCURRENT_REQUESTS_PER_TENANT": "3",
        "LORASERVE_ADAPTER_STORE": "s3://bucket/prefix",
    }
    from_env = settings([], env)
    assert from_env.max_loras == 7 and not from_env.enable_prefix_caching and from_env.port == 9001
    assert from_env.lora_modules == (("a", str(tmp_path / "a")), ("b", str(tmp_path / "b")))
    assert from_env.shutdown_timeout == 5.0 and from_env.max_concurrent_requests_per_tenant == 3
    assert from_env.adapter_store == "s3://bucket/prefix"
    flags_win = settings(["--max-loras", "2", "--enable-prefix-caching", "--model", "m"], env)
    assert flags_win.max_loras == 2 and flags_win.enable_prefix_caching and flags_win.model == "m"
    assert default.root_path == "" and settings(["--root-path", "/llm"]).root_path == "/llm"
    assert default.max_logprobs == 20 and settings(["--max-logprobs", "-1"]).max_logprobs == -1
    assert settings([], {"LORASERVE_MAX_LOGPROBS": "50"}).max_logprobs == 50
    # an on-only switch read from the environment is a bool, "false" included
    for raw, value in (("false", False), ("0", False), ("true", True), ("on", True)):
        env = {"LORASERVE_ENABLE_PROMPT_TOKENS_DETAILS": raw}
        assert settings([], env).enable_prompt_tokens_details is value


@pytest.mark.parametrize(
    "argv, env, words",
    [
        ([], {"LORASERVE_MAX_LORAS": "many"}, ["LORASERVE_MAX_LORAS", "many"]),
        ([], {"LORASERVE_ENABLE_PREFIX_CACHING": "maybe"}, ["true or false"]),
        (["--kv-cache-dtype", "int8"], {}, ["--kv-cache-dtype", "int8"]),
        ([], {"LORASERVE_KV_CACHE_DTYPE": "fp16"}, ["LORASERVE_KV_CACHE_DTYPE", "expected one of auto, fp8"]),
        (["--attention-backend", "flash"], {}, ["--attention-backend", "flash"]),
        (["--quantization", "awq"], {}, ["--quantization", "awq"]),
        ([], {"LORASERVE_QUANTIZATION": "gptq"}, ["LORASERVE_QUANTIZATION", "expected one of fp8"]),
        (
            [],
            {"LORASERVE_ATTENTION_BACKEND": "flash"},
            ["LORASERVE_ATTENTION_BACKEND", "auto, torch, triton"],
        ),
        ([], {"LORASERVE_ENFORCE_EAGER": "sometimes"}, ["LORASERVE_ENFORCE_EAGER", "true or false"]),
        ([], {"LORASERVE_RETURN_TOKENS_AS_TOKEN_IDS": "yes please"}, ["true or false"]),
        (["--api-keys", "/no/such/keys.yaml"], {}, ["--api-keys"]),
        (["--lora-modules", "nameonly"], {}, ["NAME=PATH"]),
        (["--lora-modules", "x=/no/such/dir"], {}, ["PEFT adapter folder"]),
        (["--adapter-store", "ftp://x"], {}, ["--adapter-store"]),
        (["--shutdown-timeout", "-1"], {}, ["--shutdown-timeout"]),
        (["--max-logprobs", "-2"], {}, ["--max-logprobs", "-2"]),
        (["--root-path", "llm"], {}, ["--root-path", "start with /"]),
        (["--root-path", "/llm/"], {}, ["--root-path"]),
    ],
)
def test_bad_settings_fail_with_the_flag_named(argv, env, words, capsys):
    with pytest.raises(SystemExit):
        parser = build_parser(env)
        args = parser.parse_args(["serve", *argv])
        try:
            settings_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_engine_gpu_options_from_flags_and_environment():
    default = settings([])
    assert (default.kv_cache_dtype, default.enforce_eager, default.attention_backend) == (
        "auto",
        False,
        "auto",
    )
    flags = settings(["--kv-cache-dtype", "fp8", "--enforce-eager", "--attention-backend", "torch"])
    assert (flags.kv_cache_dtype, flags.enforce_eager, flags.attention_backend) == ("fp8", True, "torch")
    env = {
        "LORASERVE_KV_CACHE_DTYPE": "fp8_e4m3",
        "LORASERVE_ENFORCE_EAGER": "true",
        "LORASERVE_ATTENTION_BACKEND": "triton",
    }
    from_env = settings([], env)
    assert (from_env.kv_cache_dtype, from_env.enforce_eager, from_env.attention_backend) == (
        "fp8_e4m3",
        True,
        "triton",
    )
    flags_win = settings(
        ["--no-enforce-eager", "--kv-cache-dtype", "auto", "--attention-backend", "auto"], env
    )
    assert (flags_win.kv_cache_dtype, flags_win.enforce_eager, flags_win.attention_backend) == (
        "auto",
        False,
        "auto",
    )
    # ... and they reach the engine.
    config = engine_config(from_env, "some/model")
    assert (config.kv_cache_dtype, config.enforce_eager, config.attention_backend) == (
        "fp8_e4m3",
        True,
        "triton",
    )
    assert engine_config(settings(["--max-logprobs", "-1"]), "some/model").max_logprobs == -1


def test_engine_flags_come_from_the_engine_declaration():
    """Each engine setting with a Flag is a flag with the declaration's default and choices (a new
    scheduling policy there is accepted here as is), and its variable is LORASERVE_<FLAG>."""
    serve = build_parser({})._subparsers._group_actions[0].choices["serve"]
    actions = {action.dest: action for action in serve._actions}
    declared = [f for f in dataclasses.fields(EngineArgs) if flag_of(f) is not None]
    assert len(declared) >= 25
    for f in declared:
        action = actions[flag_name(f).removeprefix("--").replace("-", "_")]
        assert action.option_strings[0] == flag_name(f) and action.default == f.default, f.name
        if f.metadata["choices"] is not None:
            assert list(action.choices) == [c for c in f.metadata["choices"] if c is not None], f.name
    assert list(actions["scheduling_policy"].choices) == list(SCHEDULING_POLICIES)
    policy = SCHEDULING_POLICIES[-1]
    assert settings([], {"LORASERVE_SCHEDULING_POLICY": policy}).scheduling_policy == policy
    timeout = settings(["--grammar-compile-timeout", "2.5", "--cpu-kv-cache-space", "0.5"])
    assert (timeout.grammar_compile_timeout_s, timeout.cpu_kv_cache_bytes) == (2.5, 1 << 29)
    assert engine_config(timeout, "m").grammar_compile_timeout_s == 2.5
    with pytest.raises(ValueError, match="--max-loras must be a positive integer"):
        ServerSettings(max_loras=0)  # the engine's checks run on the server's settings, naming the flag


def test_quantization_flag_reaches_the_engine():
    assert settings([]).quantization is None
    flags = settings(["--quantization", "fp8"])
    assert flags.quantization == "fp8"
    assert settings([], {"LORASERVE_QUANTIZATION": "fp8"}).quantization == "fp8"
    assert engine_config(flags, "some/model").quantization == "fp8"
    with pytest.raises(ValueError, match="--quantization 'awq' is not supported"):
        ServerSettings(quantization="awq")


def test_tensor_parallel_size_flag_reaches_the_engine():
    assert engine_config(settings([]), "some/model").tensor_parallel_size == 1
    flags = settings(["--tensor-parallel-size", "4"])
    assert engine_config(flags, "some/model").tensor_parallel_size == 4
    assert settings([], {"LORASERVE_TENSOR_PARALLEL_SIZE": "2"}).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="--tensor-parallel-size must be a positive integer"):
        ServerSettings(tensor_parallel_size=0)


def test_load_format_flag_reaches_the_engine():
    assert engine_config(settings([]), "some/model").load_format == "auto"
    assert engine_config(settings(["--load-format", "dummy"]), "some/model").load_format == "dummy"
    assert settings([], {"LORASERVE_LOAD_FORMAT": "dummy"}).load_format == "dummy"
    with pytest.raises(ValueError, match="--load-format 'pt' is not supported"):
        ServerSettings(load_format="pt")


def test_enable_expert_parallel_flag_reaches_the_engine():
    assert engine_config(settings([]), "some/model").enable_expert_parallel is False
    flags = settings(["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert engine_config(flags, "some/model").enable_expert_parallel is True
    assert settings([], {"LORASERVE_ENABLE_EXPERT_PARALLEL": "true"}).enable_expert_parallel is True


def test_kv_events_config_and_placement_key_flags():
    raw = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv@pod@model"}'
    flags = settings(["--kv-events-config", raw])
    config = engine_config(flags, "some/model").kv_events_config
    assert (config.publisher, config.endpoint, config.topic) == ("zmq", "tcp://*:5557", "kv@pod@model")
    from_env = settings([], {"LORASERVE_KV_EVENTS_CONFIG": raw, "LORASERVE_PLACEMENT_KEY": "p" * 16})
    assert engine_config(from_env, "some/model").kv_events_config == config
    assert from_env.placement_key == "p" * 16 and "p" * 16 not in repr(from_env)
    assert engine_config(settings([]), "some/model").kv_events_config is None
    with pytest.raises(ValueError, match="--kv-events-config: kv_events_config: unknown keys"):
        ServerSettings(kv_events_config='{"enable_kv_events": true}')


def test_admin_client_commands_are_registered():
    parser = build_parser({})
    args = parser.parse_args(["adapters", "list"])
    assert callable(args.func)


def test_lora_modules_preload_creates_no_version_on_restart(tmp_path):
    model_dir = make_text_model(tmp_path / "model")
    first = make_adapter(model_dir, tmp_path / "first", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    second = make_adapter(
        model_dir, tmp_path / "second", seed=2, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    store = open_store(
        StoreConfig(url=f"file://{tmp_path / 'store'}"), ModelShape.from_hf_config(load_config(model_dir))
    )
    assert preload_lora_modules(store, (("bot", str(first)),)) == ["default/bot@1"]
    # a restart with the same folder: the stored version serves (and is what the engine preloads)
    assert preload_lora_modules(store, (("bot", str(first)),)) == ["default/bot@1"]
    assert [r.version for r in store.versions("default", "bot")] == [1]
    assert preload_lora_modules(store, (("bot", str(second)),)) == ["default/bot@2"]  # changed weights
    assert [r.version for r in store.versions("default", "bot")] == [1, 2]


def test_a_lora_module_named_like_the_base_model_stops_the_start_at_once(tmp_path):
    argv = ["--model", str(tmp_path), "--served-model-name", "tiny", "--lora-modules", f"tiny={tmp_path}"]

    async def start():
        async with open_services(settings(argv)):
            pass

    with pytest.raises(NameConflict, match="'tiny' is the id of the served base model"):
        asyncio.run(start())  # before the model or any store is opened: tmp_path holds no model


def test_the_start_sweep_is_best_effort(tmp_path, caplog):
    class StoreDown:
        def sweep(self):
            raise StoreUnavailable("list the adapter store failed: connection refused")

    sweep_quietly(StoreDown())
    assert "could not sweep the adapter store" in caplog.text


def test_lora_modules_take_vllms_json_form(tmp_path):
    folder = tmp_path / "sql"
    folder.mkdir()
    spec = json.dumps({"name": "sql", "path": str(folder), "base_model_name": "tiny"})
    parsed = settings(["--served-model-name", "tiny", "--lora-modules", spec, f"chat={folder}"]).lora_modules
    assert parsed == (("sql", str(folder)), ("chat", str(folder)))
    assert parsed[0].base_model_name == "tiny" and parsed[1].base_model_name is None
    for bad in (
        '{"name": "x"}',
        '{"name": "x", "path": "p", "extra": 1}',
        "{not json",
        '{"name": "", "path": "p"}',
    ):
        with pytest.raises(SystemExit):
            settings(["--lora-modules", bad])


def test_a_lora_module_for_another_base_model_stops_the_start(tmp_path):
    spec = json.dumps({"name": "sql", "path": str(tmp_path), "base_model_name": "other-model"})
    argv = ["--model", str(tmp_path), "--served-model-name", "tiny", "--lora-modules", spec]

    async def start():
        async with open_services(settings(argv)):
            pass

    with pytest.raises(ValueError, match="base_model_name 'other-model' is not the served model 'tiny'"):
        asyncio.run(start())


def test_cuda_without_a_visible_gpu_is_refused_before_anything_loads(monkeypatch, caplog):
    import torch
    from loraserve.cli import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: no CUDA device is visible.*--gpus all"):
        check_device("cuda", "cuda")  # the CUDA image run without --gpus
    with pytest.raises(SystemExit, match="--device cuda:1: no CUDA device.*pass --device cpu"):
        check_device("cuda:1", None)
    check_device("auto", None)  # auto falls back to the CPU, as documented
    check_device("cpu", "cpu")
    assert "this is the CPU image" in caplog.text


def test_max_vocab_loras_reaches_the_engine_and_the_store():
    """Adapters with their own embedding or LM head: refused unless the server keeps room for them."""
    from loraserve.bootstrap import store_config

    default = settings([])
    assert default.max_vocab_loras == 0 and not store_config(default).vocab_modules_served
    flags = settings(["--max-vocab-loras", "2"])
    assert (
        engine_config(flags, "some/model").max_vocab_loras == 2 and store_config(flags).vocab_modules_served
    )
    assert settings([], {"LORASERVE_MAX_VOCAB_LORAS": "3"}).max_vocab_loras == 3


def test_fused_allreduce_flag_reaches_the_engine():
    assert engine_config(settings([]), "some/model").fused_allreduce is False
    flags = settings(["--tensor-parallel-size", "2", "--fused-allreduce"])
    assert engine_config(flags, "some/model").fused_allreduce is True
    assert settings([], {"LORASERVE_FUSED_ALLREDUCE": "true"}).fused_allreduce is True
