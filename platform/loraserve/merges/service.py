"""Merged adapters computed once per replica and kept as adapters of their own.

A merge's identity is its canonical description: the tenant, the base model, each part as
`name@version` with its weight, in order, the method, density and sign method. Its sha256 names the
engine adapter (`tenant/merge+<key>`, adapter_format/names.py) and seeds DARE's masks
(adapter_format/merge.py: `merge_seed`), so the same request always gets the same merged adapter, on
every replica. The first request for a merge reads the parts through the disk cache and merges them on
the work pool (never on the event loop, never in the engine core), then writes the result as a PEFT
folder under the merge directory (a temporary name renamed into place, so a reader never sees half a
merge and two front-end processes that merge at once both end with one folder); later requests find
the folder. From there the engine loads it like any stored adapter, in the background, into the CPU
tier and a GPU slot, where it counts against `max_loras` and the metrics and is evicted like the others.
The directory keeps the `max_cached` most recently used merges; an evicted one is merged again when
asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from adapter_format.errors import AdapterError
from adapter_format.files import WEIGHTS_FILE
from adapter_format.merge import (
    MergeError,
    MergeMethod,
    load_part,
    merge_adapters,
    merge_seed,
    write_merged_folder,
)
from adapter_format.model_shape import ModelShape
from adapter_format.names import format_merge_id
from adapters_store import AdapterRecord, DiskCache
from adapters_store.merged_source import merge_folder
from loraserve.work_pool import WorkPool

log = logging.getLogger(__name__)

DEFAULT_MAX_CACHED_MERGES = 256
MIN_AGE_S = 600.0  # a merge used this recently is never dropped (the engine may be about to load it)


def merge_description(
    tenant: str, base_model: str, parts: Sequence[tuple[AdapterRecord, float]], method: MergeMethod
) -> str:
    """The canonical text a merge's id and DARE seed derive from."""
    return json.dumps(
        {
            "tenant": tenant,
            "base_model": base_model,
            "parts": [[record.name, record.version, weight] for record, weight in parts],
            "method": method.method,
            "density": method.density,
            "majority_sign_method": method.majority_sign_method,
        },
        sort_keys=True,
    )


class Merges:
    def __init__(
        self,
        directory: str | Path,
        shape: ModelShape,
        max_lora_rank: int,
        base_model: str,
        max_cached: int = DEFAULT_MAX_CACHED_MERGES,
    ):
        self.directory = Path(directory)
        self.shape, self.max_lora_rank, self.base_model = shape, max_lora_rank, base_model
        self.max_cached = max_cached
        self._pending: dict[str, asyncio.Future] = {}  # merges being computed by this process

    async def ensure(
        self,
        tenant: str,
        parts: Sequence[tuple[AdapterRecord, float]],
        method: MergeMethod,
        disk_cache: DiskCache,
        work_pool: WorkPool,
    ) -> str:
        """The engine id of the merge, computed first if this replica has none; MergeError if the parts
        cannot be merged as asked."""
        description = merge_description(tenant, self.base_model, parts, method)
        key = hashlib.sha256(description.encode()).hexdigest()[:32]
        folder = merge_folder(self.directory, tenant, key)
        if (folder / WEIGHTS_FILE).is_file():
            with contextlib.suppress(OSError):  # its use, for the eviction order
                os.utime(folder)
            return format_merge_id(tenant, key)
        pending = self._pending.get(key)
        if pending is None:
            seed = merge_seed(description)
            pending = asyncio.ensure_future(
                work_pool.run(self._compute, tenant, list(parts), method, seed, folder, disk_cache)
            )
            self._pending[key] = pending
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        await asyncio.shield(pending)  # a client that leaves does not cancel the merge others wait for
        return format_merge_id(tenant, key)

    def _compute(
        self,
        tenant: str,
        parts: list[tuple[AdapterRecord, float]],
        method: MergeMethod,
        seed: int,
        folder: Path,
        disk_cache: DiskCache,
    ) -> None:
        """On the work pool: read the parts, merge, write the folder, drop the least recently used."""
        started = time.perf_counter()
        loaded = []
        with contextlib.ExitStack() as stack:
            for record, weight in parts:
                cached = stack.enter_context(disk_cache.checkout(tenant, record))
                try:
                    loaded.append(load_part(cached.path, record.ref, weight, self.shape, self.max_lora_rank))
                except AdapterError as exc:
                    raise MergeError(f"{record.ref} cannot be merged: {exc}") from None
        config, tensors = merge_adapters(loaded, method, self.shape, self.max_lora_rank, seed)
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = folder.parent / f".{folder.name}.{uuid.uuid4().hex}.tmp"
        try:
            write_merged_folder(staging, config, tensors)
            try:
                os.rename(staging, folder)
            except OSError:
                if not (folder / WEIGHTS_FILE).is_file():  # not another process's merge of the same spec
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info(
            "merged %s for tenant %r (%s) in %.2f s",
            "+".join(record.ref for record, _ in parts),
            tenant,
            method.method,
            time.perf_counter() - started,
        )
        try:
            self._evict()
        except OSError as exc:  # another front-end process evicting at once: this merge is done anyway
            log.warning("evicting old merges failed: %s", exc)

    def _evict(self) -> None:
        """Keep the `max_cached` most recently used merges (of every tenant), sparing recent ones."""
        folders = [f for tenant in self.directory.iterdir() if tenant.is_dir() for f in tenant.iterdir()]
        folders = [f for f in folders if not f.name.startswith(".")]
        if len(folders) <= self.max_cached:
            return
        now = time.time()
        by_age = sorted(folders, key=lambda f: f.stat().st_mtime)
        for folder in by_age[: len(folders) - self.max_cached]:
            if now - folder.stat().st_mtime >= MIN_AGE_S:
                shutil.rmtree(folder, ignore_errors=True)
