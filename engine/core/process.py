"""The engine core process: its entry point (a `spawn` target), start-up handshake and exit rules.

The front end binds two ipc:// sockets in a private folder and starts this process, which connects
to them, builds the engine (model, KV cache, adapter manager; no tokenizer) and answers with CoreReady,
or with CoreFailed naming why it could not start. Exit rules, so that no process is left behind:

- a ShutdownCore message: stop the adapter loaders, exit 0;
- an engine bug in the loop: CoreFailed, exit 1 (the front end fails every stream);
- the parent (the front end) is gone: exit 1 within PARENT_POLL_S, whatever the loop is doing;
- SIGINT is ignored: Ctrl-C in a terminal reaches the whole process group, and the front end decides
  when its core stops (after draining); SIGTERM sent to the core itself still ends it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.messages import CoreFailed, CoreReady, encode

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
# How long closing a socket may wait to hand the last message (CoreFailed) to the front end.
LINGER_MS = 2000


@dataclass(frozen=True)
class CoreProcessOptions:
    """Everything the core process is started with (pickled once, by multiprocessing's spawn)."""

    config: EngineConfig
    input_address: str  # ipc:// path the front end binds; the core reads requests here
    output_address: str  # ipc:// path the front end binds; the core writes StepOutputs here
    parent_pid: int
    # Where adapters come from (e.g. adapters_store's StoreAdapterSource, which pickles into a recipe);
    # None: local PEFT folders registered by name (`lora_modules`) or given as paths.
    adapter_source: Any = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    triton_cache_dir: str | None = None  # used unless TRITON_CACHE_DIR is set already
    skip_tokenizer_init: bool = False  # the core loads the tokenizer only for structured outputs
    log_level: int = logging.INFO


def run_engine_core(options: CoreProcessOptions) -> None:
    """The process's target: build the engine, say ready, run the loop, exit by the rules above."""
    _prepare_process(options)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, LINGER_MS)
    outputs.setsockopt(zmq.SNDHWM, 0)  # never block the step loop on a slow reader; the front end drains
    inputs.connect(options.input_address)
    outputs.connect(options.output_address)
    exit_code = 1
    engine = None
    try:
        started = time.perf_counter()
        adapter_events: list = []
        engine = _build_engine(options, adapter_events)
        logger.info("engine core ready in %.1f s (pid %d)", time.perf_counter() - started, os.getpid())
        ready = CoreReady(engine.max_model_len, list(engine.eos_token_ids), engine.stats())
        outputs.send(encode(ready))
        from engine.core.loop import EngineCoreLoop

        EngineCoreLoop(engine, inputs, outputs, adapter_events).run()
        exit_code = 0
    except BaseException as exc:  # start-up errors (bad model, too little memory) and engine bugs
        logger.exception("engine core failed")
        outputs.send(encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
    finally:
        if engine is not None:
            engine.shutdown()
        inputs.close(linger=0)
        outputs.close()
        context.term()
        logging.shutdown()
    # No interpreter teardown (seconds of module and CUDA clean-up for nothing): sockets are closed, the
    # adapter loaders see their pipes close, and the front end waits on this exit.
    os._exit(exit_code)


def _build_engine(options: CoreProcessOptions, adapter_events: list):
    from engine.llm_engine import LLMEngine  # after the environment is set: torch and Triton read it

    engine = LLMEngine(
        options.config,
        skip_tokenizer_init=options.skip_tokenizer_init,
        detokenize=False,  # text is the front end's job
        output_kind="delta",  # each step's new tokens only: the messages carry nothing twice
        adapter_source=options.adapter_source,
        adapter_observer=lambda event, tier, seconds=0.0: adapter_events.append((event, tier, seconds)),
    )
    for name, path in options.lora_modules:
        engine.register_adapter(name, path)
    return engine


def _prepare_process(options: CoreProcessOptions) -> None:
    if options.triton_cache_dir and not os.environ.get("TRITON_CACHE_DIR"):
        os.makedirs(options.triton_cache_dir, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = options.triton_cache_dir
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=options.log_level, format="%(asctime)s %(levelname)s %(name)s [engine-core]: %(message)s"
    )
    threading.Thread(
        target=_exit_when_orphaned, args=(options.parent_pid,), name="parent-watch", daemon=True
    ).start()


def _exit_when_orphaned(parent_pid: int) -> None:
    """A core whose front end died serves nobody: exit (its adapter loaders see their pipes close)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.error("the front end (pid %d) is gone: the engine core exits", parent_pid)
            os._exit(1)
