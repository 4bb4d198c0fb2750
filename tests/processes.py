"""Process bookkeeping for tests of process boundaries (Linux /proc): children, liveness, bounded waits."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The live (non-zombie) processes whose parent is `pid`."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        state, parent = fields[0], int(fields[1])
        if parent == pid and state != "Z":
            children.append(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_quietly(pid: int) -> None:
    """SIGKILL `pid` if it still runs (cleanup after a failed test)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
