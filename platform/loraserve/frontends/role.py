"""What a server process does differently when it is the only one, or one front end of several.

`open_services` (bootstrap.py) builds the same Services either way and asks its role for the parts
that differ:

| | `SingleProcess` (`--api-server-count 1`) | `FrontEnd` (one of N, frontends.worker) |
|---|---|---|
| engine | starts the core (`AsyncLLM.from_config`) | joins the supervisor's core (`AsyncLLM.connect`) |
| tenant counters | a table in its own memory | the table all front ends map (tenancy.tenant_table) |
| metrics | its own registry | prometheus_client's multiprocess files, summed |
| config events | the store's own | also to and from the other front ends (peer_events) |
| route-write lock (embedded store) | per tenant, in this process | per tenant, across the front ends (tenant_locks) |
| store upkeep | sweeps the store, stores `--lora-modules` | none: the supervisor did it once |
| /ready | its own state | also every other front end's (FrontEndStatus) |
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from engine import AsyncLLM, EngineConfig
from engine.core_process.handle import CoreAddresses
from engine.model.loader import resolve_model_path
from engine.tokenizer import load_tokenizer
from loraserve.config_store.base import ConfigStore
from loraserve.config_store.embedded import EmbeddedConfigStore
from loraserve.frontends.peer_events import PeerEventsConfigStore
from loraserve.frontends.placement import cpu_plan
from loraserve.frontends.runtime import READY, STOPPING, FrontEndStatus, Runtime
from loraserve.frontends.tenant_locks import SharedTenantLocks
from loraserve.settings import ServerSettings
from loraserve.tenancy.tenant_table import TenantTable


class SingleProcess:
    """The one server process of `--api-server-count 1`: it starts and owns the engine core."""

    owns_store_upkeep = True
    metrics_dir: str | None = None
    front_ends = None

    def __init__(self, settings: ServerSettings) -> None:
        self._settings = settings

    def tenant_table(self) -> TenantTable:
        return TenantTable.in_process()

    def config_store(self, backend: ConfigStore) -> ConfigStore:
        return backend

    async def start_engine(self, config: EngineConfig, **options: Any) -> AsyncLLM:
        plan = cpu_plan(self._settings)
        return await asyncio.to_thread(AsyncLLM.from_config, config, cpu_plan=plan, **options)


class FrontEnds:
    """This front end's view of all of them, for /ready: the replica is ready when every one is."""

    def __init__(self, status: FrontEndStatus, slot: int) -> None:
        self._status = status
        self.slot = slot

    def mark_ready(self) -> None:
        self._status.set(self.slot, READY)

    def mark_stopping(self) -> None:
        self._status.set(self.slot, STOPPING)

    def not_ready_reason(self) -> str | None:
        waiting = [slot for slot in self._status.not_ready() if slot != self.slot]
        if not waiting:
            return None
        return f"front-end process(es) {', '.join(map(str, waiting))} of this server not serving yet"


class FrontEnd:
    """Front-end process `slot` of several: it joins the engine core the supervisor started."""

    owns_store_upkeep = False

    def __init__(self, slot: int, runtime: Runtime, core: CoreAddresses) -> None:
        self.slot = slot
        self.runtime = runtime
        self.core = core
        self.client_id = f"fe-{slot}-{os.getpid()}"
        self.metrics_dir = str(runtime.metrics_dir)
        self.front_ends = FrontEnds(FrontEndStatus(runtime.status_path), slot)

    def tenant_table(self) -> TenantTable:
        return TenantTable.attach(self.runtime.limits_path, self.runtime.num_front_ends, self.slot)

    def config_store(self, backend: ConfigStore) -> ConfigStore:
        if not isinstance(backend, EmbeddedConfigStore):  # Redis tells every process itself
            return backend
        locks = SharedTenantLocks(self.runtime.locks_dir)
        return PeerEventsConfigStore(
            backend, self.runtime.events_in, self.runtime.events_out, self.client_id, locks
        )

    async def start_engine(
        self, config: EngineConfig, *, adapter_source: Any = None, adapter_observer: Any = None, **_: Any
    ) -> AsyncLLM:
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model_path(config.model))
        return await asyncio.to_thread(
            AsyncLLM.connect,
            self.core,
            self.client_id,
            tokenizer=tokenizer,
            adapter_source=adapter_source,
            adapter_observer=adapter_observer,
        )
