"""The per-tenant route-write lock across front-end processes (embedded config store): processes racing
to create routes past the tenant's quota store exactly the quota, a held lock keeps other processes'
writers out until it is released, and a killed holder's lock is free at once."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
from loraserve.config_store.embedded import EmbeddedConfigStore
from loraserve.frontends.tenant_locks import SharedTenantLocks
from loraserve.routing.route import Route, Variant

NUM_PROCESSES = 3
QUOTA = 3


class _FrontEndStore(EmbeddedConfigStore):
    """The embedded store with a front end's lock (PeerEventsConfigStore does the same, with events)."""

    def __init__(self, root, locks_dir) -> None:
        super().__init__(root)
        self._locks = SharedTenantLocks(locks_dir)

    def _tenant_lock(self, tenant: str):
        return self._locks(tenant)


def _create_routes(root, locks_dir, index: int, start, results) -> None:
    store = _FrontEndStore(root, locks_dir)

    async def check(names: list[str]) -> None:
        await asyncio.sleep(0.05)  # wide race window: another process's write would land meanwhile
        if len(names) >= QUOTA:
            raise PermissionError("quota")

    async def main() -> int:
        stored = 0
        for j in range(QUOTA):
            route = Route(name=f"r{index}-{j}", variants=(Variant(adapter="a", weight=1),))
            try:
                await store.put_route_checked("acme", route, check)
                stored += 1
            except PermissionError:
                pass
        return stored

    start.wait(30)
    results.put(asyncio.run(main()))


def _hold(locks_dir, held, release_file) -> None:
    async def main() -> None:
        async with SharedTenantLocks(locks_dir)("acme"):
            held.set()
            for _ in range(3000):  # until the test lets go (a file: an Event would deadlock a kill)
                if release_file.exists():
                    break
                await asyncio.sleep(0.01)

    asyncio.run(main())


def _spawn(target, *args):
    process = multiprocessing.get_context("spawn").Process(target=target, args=args)
    process.start()
    return process


def _reap(*processes) -> None:
    for process in processes:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(5)


@pytest.mark.slow
def test_processes_racing_past_the_route_quota_store_exactly_the_quota(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(NUM_PROCESSES), context.Queue()
    processes = [
        _spawn(_create_routes, tmp_path / "config", locks, i, start, results) for i in range(NUM_PROCESSES)
    ]
    try:
        stored = [results.get(timeout=60) for _ in processes]
    finally:
        _reap(*processes)
    routes = asyncio.run(EmbeddedConfigStore(tmp_path / "config").list_routes("acme"))
    assert sum(stored) == len(routes) == QUOTA, (stored, [r.name for r in routes])


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["release", "kill"])
def test_a_held_lock_keeps_other_processes_out_until_its_holder_lets_go_or_dies(tmp_path, ending):
    (tmp_path / "locks").mkdir()
    context = multiprocessing.get_context("spawn")
    held, release = context.Event(), tmp_path / "release"
    holder = _spawn(_hold, tmp_path / "locks", held, release)
    try:
        assert held.wait(60)
        locks = SharedTenantLocks(tmp_path / "locks")

        async def main() -> tuple[bool, bool]:
            other_tenant = asyncio.ensure_future(locks("other").__aenter__())
            blocked = asyncio.ensure_future(locks("acme").__aenter__())
            await asyncio.sleep(0.3)
            waited = not blocked.done()
            if ending == "release":
                release.touch()
            else:
                holder.kill()  # SIGKILL: the kernel drops its file lock
            await asyncio.wait_for(blocked, 30)
            return other_tenant.done(), waited

        other_free, waited = asyncio.run(main())
        assert other_free  # another tenant's lock was never held up
        assert waited  # acme's waited for the other process
    finally:
        release.touch()
        _reap(holder)
