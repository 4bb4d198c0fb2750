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


def connection_owner(server_port: int, client_port: int, candidates: list[int]) -> int | None:
    """Which of `candidates` holds the server end of the loopback TCP connection from `client_port`
    (IPv4; /proc/net/tcp, then each candidate's open descriptors)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == client_port:
            inode = fields[9]
            break
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in candidates:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    if os.readlink(fd) == target:
                        return pid
                except OSError:
                    continue
        except OSError:
            continue
    return None


def process_group(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None
