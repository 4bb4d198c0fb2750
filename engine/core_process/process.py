"""The engine core process: its entry point (a `spawn` target), start-up handshake and exit rules.

Whoever starts the core (engine.core_process.handle.CoreHandle) picks two ipc:// addresses in a private
folder; the core binds a ROUTER socket on each before it loads anything, so front ends ("clients",
engine.core_process.clients) may connect at once: one (AsyncLLM.from_config) or several (`loraserve serve
--api-server-count N`). It then builds the engine (model, KV cache, adapter manager; no tokenizer) and
answers each client's ClientHello with CoreReady, or with CoreFailed naming why it could not start. Its
CPUs, threads and garbage collector are set for a steady loop (engine.core.steady). Exit rules, so that
no process is left behind:

- a ShutdownCore message: stop the adapter loaders, exit 0;
- an engine bug in the loop: CoreFailed to every client, exit 1 (the front ends fail every stream);
- the parent (whoever started it) is gone: exit 1 within PARENT_POLL_S, whatever the loop is doing;
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

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core import steady
from engine.messages import ClientHello, CoreFailed, decode_input, encode

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
# How long closing a socket may wait to hand the last message (CoreFailed) to the clients.
LINGER_MS = 2000
# A core that fails at start waits this long for the hellos of clients still connecting, to tell them why.
FAILED_HELLO_WAIT_S = 2.0


@dataclass(frozen=True)
class CoreProcessOptions:
    """Everything the core process is started with (pickled once, by multiprocessing's spawn)."""

    config: EngineConfig
    input_address: str  # ipc:// path the core binds (ROUTER); clients send requests here
    output_address: str  # ipc:// path the core binds (ROUTER); clients say hello and read outputs here
    parent_pid: int
    # Where adapters come from (e.g. adapters_store's StoreAdapterSource, which pickles into a recipe);
    # None: local PEFT folders registered by name (`lora_modules`) or given as paths.
    adapter_source: Any = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    triton_cache_dir: str | None = None  # used unless TRITON_CACHE_DIR is set already
    skip_tokenizer_init: bool = False  # the core loads the tokenizer only for structured outputs
    log_level: int = logging.INFO
    cpu_plan: steady.CpuPlan | None = None  # where the loop runs (engine.core.steady); None: anywhere


def run_engine_core(options: CoreProcessOptions) -> None:
    """The process's target: build the engine, say ready, run the loop, exit by the rules above."""
    _prepare_process(options)
    steady.enter_core(options.cpu_plan)
    context = zmq.Context()
    inputs = context.socket(zmq.ROUTER)
    outputs = context.socket(zmq.ROUTER)
    outputs.setsockopt(zmq.LINGER, LINGER_MS)
    outputs.setsockopt(zmq.SNDHWM, 0)  # never block the step loop on a slow reader; each client drains
    inputs.setsockopt(zmq.RCVHWM, 0)
    for socket in (inputs, outputs):
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client that reconnects keeps its route
    inputs.bind(options.input_address)
    outputs.bind(options.output_address)
    exit_code = 1
    engine = None
    loop = None
    try:
        started = time.perf_counter()
        adapter_events: list = []
        engine = _build_engine(options, adapter_events)
        logger.info("engine core ready in %.1f s (pid %d)", time.perf_counter() - started, os.getpid())
        from engine.core_process.loop import EngineCoreLoop

        loop = EngineCoreLoop(engine, inputs, outputs, adapter_events)
        steady.enter_loop(options.cpu_plan, cuda=options.config.torch_device.type == "cuda")
        loop.run()
        exit_code = 0
    except BaseException as exc:  # start-up errors (bad model, too little memory) and engine bugs
        logger.exception("engine core failed")
        failed = encode(CoreFailed(f"{type(exc).__name__}: {exc}"))
        clients = loop.clients.ids if loop is not None else _hellos(outputs, FAILED_HELLO_WAIT_S)
        for client in clients:
            try:
                outputs.send_multipart([client, failed], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that client is gone already
    finally:
        if engine is not None:
            engine.shutdown()
        inputs.close(linger=0)
        outputs.close()
        context.term()
        logging.shutdown()
    # No interpreter teardown (seconds of module and CUDA clean-up for nothing): sockets are closed, the
    # adapter loaders see their pipes close, and the front ends wait on this exit.
    os._exit(exit_code)


def _hellos(outputs: zmq.Socket, wait_s: float) -> list[bytes]:
    """The clients that said hello before the loop ever ran (waiting up to `wait_s` for a first one)."""
    clients: list[bytes] = []
    deadline = time.monotonic() + wait_s
    while True:
        remaining_ms = 0 if clients else max(0, int(1000 * (deadline - time.monotonic())))
        if not outputs.poll(remaining_ms):
            return clients
        frames = outputs.recv_multipart()
        try:
            if len(frames) == 2 and isinstance(decode_input(frames[1]), ClientHello):
                clients.append(frames[0])
        except msgspec.ValidationError:
            pass


def _build_engine(options: CoreProcessOptions, adapter_events: list):
    from engine.engine_core import EngineCore  # after the environment is set: torch and Triton read it

    engine = EngineCore(  # token deltas only: text is the front end's job
        options.config,
        skip_tokenizer_init=options.skip_tokenizer_init,
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
    """A core whose starter died serves nobody: exit (its adapter loaders see their pipes close)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.error("the process that started it (pid %d) is gone: the engine core exits", parent_pid)
            os._exit(1)
