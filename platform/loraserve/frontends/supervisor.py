"""The main process of `loraserve serve --api-server-count N` (N > 1): it serves no request itself.

At start it does, once, what must happen once: converts the demo model if needed, checks and sweeps
the adapter store, binds the listening sockets (API and metrics), makes the shared runtime folder
(frontends.runtime), starts the config-event hub (frontends.peer_events) and the engine core
(engine.core_process.handle), spawns N front-end processes (frontends.worker) on the shared sockets, and
puts `--lora-modules` into the store and the core's CPU tier. Then it watches:

| what happens | what it does |
|---|---|
| SIGTERM or SIGINT | forwards SIGTERM to every front end (each drains); once they exit, stops the core; exit 0 |
| a second SIGTERM/SIGINT | forwards it again: the front ends stop at once |
| a front end dies | its connections are cut (clients see the stream end without [DONE]); the core is told (ClientGone) and aborts its requests; its leases and token holds are cleared; a new one takes its slot. More than MAX_RESTARTS in RESTART_WINDOW_S: the server stops, exit 1 |
| the engine core dies | every front end fails its streams (engine_dead) and exits; then exit 1 |
| the supervisor dies (kill -9) | the core and every front end notice within a second and exit |
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import wait

import uvicorn

from adapters_store import DiskCache, open_store
from adapters_store.engine_source import StoreAdapterSource
from adapters_store.merged_source import MergedAdapterSource
from engine import model_shape
from engine.core.steady import pin_process
from engine.core_process.handle import JOIN_S, CoreHandle
from engine.messages import ClientGone, PreloadAdapters
from engine.model.loader import load_config, resolve_model_path
from loraserve.bootstrap import (
    _demo_model,
    base_model_id,
    check_lora_modules,
    engine_config,
    preload_lora_modules,
    store_config,
    sweep_quietly,
)
from loraserve.frontends.peer_events import start_hub
from loraserve.frontends.placement import api_server_count, cpu_plan
from loraserve.frontends.runtime import STARTING, FrontEndStatus, Runtime
from loraserve.frontends.worker import FrontEndOptions, run_front_end
from loraserve.settings import ServerSettings
from loraserve.tenancy.tenant_table import TenantTable

log = logging.getLogger("loraserve")

MAX_RESTARTS = 3  # per front-end slot within RESTART_WINDOW_S; beyond, something is wrong for good
RESTART_WINDOW_S = 60.0
_POLL_S = 0.1
_STOP_GRACE_S = 15.0  # beyond --shutdown-timeout, for the drained front ends to close and exit


@dataclasses.dataclass
class _Slot:
    index: int
    process: multiprocessing.process.BaseProcess
    restarts: deque = dataclasses.field(default_factory=deque)

    @property
    def client_id(self) -> str:
        return f"fe-{self.index}-{self.process.pid}"


class Supervisor:
    def __init__(self, settings: ServerSettings, log_level: str = "info") -> None:
        self.settings = settings
        self.log_level = log_level
        self.count = api_server_count(settings)
        self._signals = 0
        self._context = multiprocessing.get_context("spawn")

    def run(self) -> int:
        settings = self.settings
        plan = cpu_plan(settings)
        if plan is not None:  # the supervisor, the front ends and the loaders stay off the loop's CPUs
            pin_process(plan.others)
        model = settings.model or str(_demo_model(settings))
        model_id = base_model_id(settings, model)
        try:
            check_lora_modules(settings, model, model_id)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        shape = model_shape(
            load_config(resolve_model_path(model))
        )  # sizes and the architecture's LoRA targets
        config = store_config(settings)
        store = open_store(config, shape)
        store.check()
        threading.Thread(target=sweep_quietly, args=(store,), name="adapter-store-sweep", daemon=True).start()
        disk_cache = DiskCache(
            store, config.cache_dir, config.cache_max_bytes, min_free_bytes=config.cache_min_free_bytes
        )
        # Everything from here on is undone on the way out, a failed start included (a taken port, a core
        # that cannot start): the /dev/shm folder, the sockets, the core, every front end.
        with contextlib.ExitStack() as undo:
            runtime = Runtime.create(self.count)
            undo.callback(runtime.remove)
            log.info("shared runtime folder: %s (removed at exit)", runtime.folder)
            # Before any front end starts: prometheus_client reads it when first imported there.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(runtime.metrics_dir)
            start_hub(runtime.events_in, runtime.events_out)
            from loraserve.http_server import listening_sockets

            sockets = listening_sockets(
                settings, uvicorn.Config("loraserve.app:create_app", host=settings.host, port=settings.port)
            )
            for sock in sockets:
                undo.callback(sock.close)
            source = MergedAdapterSource(
                StoreAdapterSource(store, disk_cache, shape, settings.max_lora_rank), settings.merges_dir
            )
            handle = CoreHandle.start(
                engine_config(settings, model),
                adapter_source=source,
                triton_cache_dir=str(settings.triton_cache_dir),
                cpu_plan=plan,
            )
            undo.callback(handle.shutdown)
            return self._serve(handle, sockets, runtime, model, model_id, store, undo)

    def _serve(self, handle, sockets, runtime, model, model_id, store, undo: contextlib.ExitStack) -> int:
        settings = self.settings
        # The front ends serve what the supervisor resolved: the model's folder and id; the store holds
        # the --lora-modules once this process has stored them.
        front_settings = dataclasses.replace(
            settings, model=model, served_model_name=model_id, lora_modules=()
        )
        options = [
            FrontEndOptions(
                i, front_settings, tuple(sockets), handle.addresses, runtime, os.getpid(), self.log_level
            )
            for i in range(self.count)
        ]
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        undo.callback(lambda: [signal.signal(sig, handler) for sig, handler in previous.items()])
        slots: list[_Slot] = []
        undo.callback(lambda: [_stop(slot.process, signal.SIGKILL) for slot in slots])
        for i, option in enumerate(options):
            slots.append(_Slot(i, self._spawn(option)))
        log.info(
            "serving on http://%s:%d with %d front-end processes (pids %s) and the engine core (pid %d)",
            settings.host,
            settings.port,
            self.count,
            ", ".join(str(s.process.pid) for s in slots),
            handle.pid,
        )
        if settings.lora_modules:  # into the core's CPU tier now, not at the first request
            handle.send(PreloadAdapters(preload_lora_modules(store, settings.lora_modules)))
        return self._watch(handle, slots, options, runtime)

    def _spawn(self, options: FrontEndOptions) -> multiprocessing.process.BaseProcess:
        process = self._context.Process(
            target=run_front_end, args=(options,), name=f"front-end-{options.slot}"
        )
        process.start()
        return process

    def _on_signal(self, signum: int, frame) -> None:
        self._signals += 1

    def _watch(
        self, handle: CoreHandle, slots: list[_Slot], options: list[FrontEndOptions], runtime: Runtime
    ) -> int:
        forwarded = 0
        deadline = None
        table = TenantTable.attach(runtime.limits_path, runtime.num_front_ends, slot=0)
        status = FrontEndStatus(runtime.status_path)
        try:
            while True:
                wait([handle.process.sentinel, *(s.process.sentinel for s in slots)], timeout=_POLL_S)
                if self._signals > forwarded:  # SIGTERM or Ctrl-C: every front end drains
                    forwarded = self._signals
                    log.info("stopping: the front ends drain (up to %.0f s)", self.settings.shutdown_timeout)
                    for slot in slots:
                        _stop(slot.process, signal.SIGTERM)
                    deadline = time.monotonic() + self.settings.shutdown_timeout + _STOP_GRACE_S
                if not handle.alive():
                    return self._core_died(handle, slots, stopping=deadline is not None)
                for slot in slots:
                    if slot.process.is_alive() or deadline is not None:
                        continue
                    if not self._replace(slot, options[slot.index], handle, table, status):
                        return self._stop_all(slots, code=1)
                if deadline is not None:
                    if not any(s.process.is_alive() for s in slots):
                        return 0
                    if time.monotonic() > deadline:
                        log.error(
                            "front ends still running %.0f s after SIGTERM: killing them", _STOP_GRACE_S
                        )
                        return self._stop_all(slots, code=0)
        finally:
            table.close()
            status.close()

    def _replace(
        self,
        slot: _Slot,
        options: FrontEndOptions,
        handle: CoreHandle,
        table: TenantTable,
        status: FrontEndStatus,
    ) -> bool:
        """Front end `slot` died: clear what it held, tell the core, start another; False to give up."""
        code = slot.process.exitcode
        log.error("front-end process %d (pid %d) exited with %s", slot.index, slot.process.pid, code)
        with table.locked():
            table.clear_slot(slot.index)
        status.set(slot.index, STARTING)
        handle.send(ClientGone(slot.client_id))
        now = time.monotonic()
        while slot.restarts and now - slot.restarts[0] > RESTART_WINDOW_S:
            slot.restarts.popleft()
        if len(slot.restarts) >= MAX_RESTARTS:
            log.error(
                "front-end process %d died %d times within %.0f s: stopping the server",
                slot.index,
                MAX_RESTARTS + 1,
                RESTART_WINDOW_S,
            )
            return False
        slot.restarts.append(now)
        slot.process = self._spawn(options)
        log.info("front-end process %d restarted (pid %d)", slot.index, slot.process.pid)
        return True

    def _core_died(self, handle: CoreHandle, slots: list[_Slot], *, stopping: bool) -> int:
        """Every front end sees the core's death itself, fails its streams and exits; wait for them."""
        handle.process.join(JOIN_S)
        if stopping:
            log.info("the engine core stopped")
        else:
            log.error("the engine core exited unexpectedly (exit code %s)", handle.process.exitcode)
        deadline = time.monotonic() + _STOP_GRACE_S
        while any(s.process.is_alive() for s in slots) and time.monotonic() < deadline:
            wait([s.process.sentinel for s in slots], timeout=_POLL_S)
        return self._stop_all(slots, code=0 if stopping else 1)

    def _stop_all(self, slots: list[_Slot], code: int) -> int:
        for slot in slots:
            _stop(slot.process, signal.SIGTERM)
        for slot in slots:
            slot.process.join(JOIN_S)
            _stop(slot.process, signal.SIGKILL)
        return code


def _stop(process: multiprocessing.process.BaseProcess, sig: int) -> None:
    if process.pid is not None and process.is_alive():
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            process.join(JOIN_S)
