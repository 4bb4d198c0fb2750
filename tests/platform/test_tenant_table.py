"""The tenant table that front-end processes share: a check and its update are one step for the whole
replica (processes racing for the last slot admit exactly the limit), a dead process's leases and holds
are cleared with its column, the parallel-upload cap holds for the replica, rows of idle tenants are reused, and the token window behaves as the
in-process one does."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest
from loraserve.tenancy import ConcurrencyLimiter, Principal, TokenRateLimiter, TooManyRequests
from loraserve.tenancy.tenant_table import NO_ROW, TenantTable
from loraserve.tenancy.upload_slots import UploadSlots

NUM_PROCESSES = 3
LIMIT = 5


def _race(path, slot: int, start, results) -> None:
    """One front-end process: try to take as many of the tenant's slots as it can."""
    table = TenantTable.attach(path, NUM_PROCESSES, slot)
    limiter = ConcurrencyLimiter(LIMIT, table=table)
    who = Principal(tenant="alice", role="user")
    start.wait(30)
    admitted = 0
    for _ in range(LIMIT):
        try:
            limiter.try_acquire(who)  # leases are kept: the process "serves" them
            admitted += 1
        except TooManyRequests:
            pass
    results.put(admitted)


def test_processes_racing_for_slots_admit_exactly_the_replica_limit(tmp_path):
    path = tmp_path / "limits"
    TenantTable.create(path, NUM_PROCESSES, capacity=16)
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(NUM_PROCESSES), context.Queue()
    processes = [context.Process(target=_race, args=(path, i, start, results)) for i in range(NUM_PROCESSES)]
    for process in processes:
        process.start()
    try:
        admitted = [results.get(timeout=60) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert sum(admitted) == LIMIT, admitted  # never more, whichever process asked
    supervisor = TenantTable.attach(path, NUM_PROCESSES, 0)
    with supervisor.locked() as table:
        row = table.row("alice", now=time.monotonic(), create=False)
        assert table.in_flight(row) == LIMIT
        for slot in range(NUM_PROCESSES):  # every process died: its leases go with it
            table.clear_slot(slot)
        assert table.in_flight(row) == 0


def test_a_dead_process_holds_nothing_after_its_column_is_cleared(tmp_path):
    path = tmp_path / "limits"
    TenantTable.create(path, 2, capacity=8)
    alive, dead = TenantTable.attach(path, 2, 0), TenantTable.attach(path, 2, 1)
    who = Principal(tenant="bob", role="user", max_tokens_per_minute=100)
    ConcurrencyLimiter(1, table=dead).try_acquire(who)
    TokenRateLimiter(table=dead).try_reserve(who, 10, 80)  # 10 used, 80 held by the process that dies
    survivor = TokenRateLimiter(table=alive)
    with pytest.raises(TooManyRequests):
        ConcurrencyLimiter(1, table=alive).try_acquire(who)
    with pytest.raises(TooManyRequests):
        survivor.try_reserve(who, 5, 10)
    with alive.locked():
        alive.clear_slot(1)
    ConcurrencyLimiter(1, table=alive).try_acquire(who)
    survivor.try_reserve(who, 5, 10)  # its use stays (tokens used are used), its hold is gone
    assert (survivor.used("bob"), survivor.held("bob")) == (15, 10)


def test_rows_of_idle_tenants_are_reused_and_a_full_table_admits_unlimited(tmp_path, caplog):
    path = tmp_path / "limits"
    TenantTable.create(path, 1, capacity=2)
    table = TenantTable.attach(path, 1, 0)
    limiter = ConcurrencyLimiter(1, table=table)
    now = time.monotonic()
    first = limiter.try_acquire(Principal(tenant="t1", role="user"))
    limiter.try_acquire(Principal(tenant="t2", role="user"))
    first.release()  # t1 idles now: nothing running, held or in its window
    limiter.try_acquire(Principal(tenant="t3", role="user"))  # takes t1's row
    with table.locked():
        assert table.row("t1", now=now, create=False) == NO_ROW
        assert table.row("t3", now=now, create=False) != NO_ROW
    for _ in range(3):  # t4 finds no row: admitted without a count, and the log says so
        limiter.try_acquire(Principal(tenant="t4", role="user"))
    assert "full of active tenants" in caplog.text


def test_the_in_process_table_grows_and_keeps_the_window():
    limiter = TokenRateLimiter(clock=lambda: 1000.0)
    for i in range(200):  # more tenants than the first allocation
        limiter.try_reserve(Principal(tenant=f"t{i}", role="user"), 3)
    assert limiter.used("t0") == 3 and limiter.used("t199") == 3


def test_the_upload_cap_holds_for_the_replica_and_a_dead_process_frees_its_uploads(tmp_path):
    path = tmp_path / "limits"
    TenantTable.create(path, 2, capacity=8)
    first, second = TenantTable.attach(path, 2, 0), TenantTable.attach(path, 2, 1)
    here, there = UploadSlots(2, table=first), UploadSlots(2, table=second)

    async def scenario():
        async with here.acquire("carol"), there.acquire("carol"):  # one upload in each process
            with pytest.raises(TooManyRequests, match="2 adapter uploads in progress"):
                async with here.acquire("carol"):
                    pass
            async with there.acquire("dave"):  # another tenant's cap is its own
                assert (here.in_flight("carol"), here.in_flight("dave")) == (2, 1)
            with second.locked():
                second.clear_slot(1)  # the second process died with its upload
            async with here.acquire("carol"):  # its slot is free again
                assert there.in_flight("carol") == 2
        return here.in_flight("carol")

    assert asyncio.run(scenario()) == 0
