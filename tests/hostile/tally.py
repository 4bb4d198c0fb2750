"""Counting what the hostile probe sees: per category, requests tried, bad input wrongly accepted, 5xx
answers, stalls (the event loop or other tenants kept waiting), leaks (another tenant's data, a server
path, a lease or a file left behind, memory that grows) and other failures (a valid request refused, an
error without OpenAI's body, a stream without its end). A thread polls /health on both ports the whole
time; a slow answer is a stall of the category running then."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from dataclasses import dataclass, field

import httpx

HEALTH_BOUND_S = 3.0  # the shipped readiness probe's timeout is a few seconds; a shared 2-core host is noisy
STALL_BOUND_S = 8.0  # another tenant's 4-token request or /tokenize must answer within this


@dataclass
class Row:
    tried: int = 0
    wrongly_accepted: int = 0
    server_errors: int = 0
    stalls: int = 0
    leaks: int = 0
    other: int = 0
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.notes) < 6:
            self.notes.append(text[:300])


class Tally:
    def __init__(self, secrets: list[str]) -> None:
        self.rows: dict[str, Row] = {}
        self.current = "setup"
        self.secrets = secrets  # strings no answer may carry (server paths)
        self.streams = 0
        self.worst_health: dict[str, float] = {}

    def row(self, category: str | None = None) -> Row:
        return self.rows.setdefault(category or self.current, Row())

    def begin(self, category: str) -> None:
        self.current = category
        self.row(category)

    # -- classification ---------------------------------------------------------------------------

    def answer(
        self,
        response: httpx.Response,
        *,
        refuse: bool | None,
        what: str,
        hidden: tuple[str, ...] = (),
        category: str | None = None,
        echo: str = "",
        unavailable_ok: bool = False,
    ) -> httpx.Response:
        """Count one answer. `refuse`: True for bad input (must be 4xx), False for a valid request (must be
        2xx), None when either is right. `hidden`: names this caller must never see (another tenant's);
        `echo`: the caller's own text, which the answer may quote; `unavailable_ok`: a 503 is right here
        (the server is stopping)."""
        row = self.row(category)
        row.tried += 1
        status = response.status_code
        text = response.text
        if status == 503 and unavailable_ok:
            pass
        elif status >= 500:
            row.server_errors += 1
            row.note(f"{what}: {status} {text[:160]}")
        elif refuse is True and status < 400:
            row.wrongly_accepted += 1
            row.note(f"{what}: accepted ({status}) {text[:120]}")
        elif refuse is False and status >= 400:
            row.other += 1
            row.note(f"{what}: a valid request refused: {status} {text[:160]}")
        if status >= 400 and not _openai_error(text):
            row.other += 1
            row.note(f"{what}: {status} without OpenAI's error body: {text[:120]}")
        self.scan(text.replace(echo, "") if echo else text, what, hidden, category)
        return response

    def scan(self, text: str, what: str, hidden: tuple[str, ...] = (), category: str | None = None) -> None:
        found = [s for s in (*self.secrets, *hidden) if s and s in text]
        if found:
            row = self.row(category)
            row.leaks += 1
            row.note(f"{what}: the answer names {found[0]!r}: {text[:160]}")

    def failed(self, kind: str, what: str, category: str | None = None) -> None:
        """kind: wrongly_accepted, server_errors, stalls, leaks or other."""
        row = self.row(category)
        setattr(row, kind, getattr(row, kind) + 1)
        row.note(what)

    def tried(self, count: int = 1, category: str | None = None) -> None:
        self.row(category).tried += count

    # -- the report -------------------------------------------------------------------------------

    def table(self) -> str:
        lines = [
            "| category | tried | wrongly accepted | 5xx | stalls | leaks | other |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        total = Row()
        for name, row in self.rows.items():
            if name == "setup" and not row.tried:
                continue
            cells = [row.tried, row.wrongly_accepted, row.server_errors, row.stalls, row.leaks, row.other]
            lines.append(f"| {name} | " + " | ".join(map(str, cells)) + " |")
            for attribute in ("tried", "wrongly_accepted", "server_errors", "stalls", "leaks", "other"):
                setattr(total, attribute, getattr(total, attribute) + getattr(row, attribute))
        cells = [
            total.tried,
            total.wrongly_accepted,
            total.server_errors,
            total.stalls,
            total.leaks,
            total.other,
        ]
        lines.append("| **total** | " + " | ".join(f"**{c}**" for c in cells) + " |")
        return "\n".join(lines)

    def failures(self) -> list[str]:
        return [f"{name}: {note}" for name, row in self.rows.items() for note in row.notes]

    def clean(self) -> bool:
        return not any(
            r.wrongly_accepted or r.server_errors or r.stalls or r.leaks or r.other
            for r in self.rows.values()
        )


def _openai_error(text: str) -> bool:
    try:
        error = json.loads(text)["error"]
        return all(isinstance(error.get(k), str) for k in ("message", "type", "code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


class HealthWatch:
    """Polls /health on the API port and the metrics listener every 0.25 s from a process of its own (so
    the probe's own work never delays it); an answer slower than HEALTH_BOUND_S, or none, is a stall of
    the category running at the time."""

    def __init__(self, tally: Tally, urls: list[str]) -> None:
        self.tally = tally
        self.urls = urls
        context = multiprocessing.get_context("spawn")
        self._queue = context.Queue()
        self._stop = context.Event()
        self._process = context.Process(target=_poll, args=(urls, self._queue, self._stop), daemon=True)
        self._paused = threading.Event()
        self._reader = threading.Thread(target=self._read, name="health-watch", daemon=True)

    def __enter__(self) -> HealthWatch:
        self._process.start()
        self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._queue.put(None)
        self._reader.join(timeout=30)

    def pause(self, paused: bool) -> None:
        """Paused while the server is meant to stop (the shutdown probes)."""
        (self._paused.set if paused else self._paused.clear)()

    def _read(self) -> None:
        while (sample := self._queue.get()) is not None:
            url, latency, ok = sample
            if self._paused.is_set():
                continue
            category = self.tally.current
            worst = self.tally.worst_health
            worst[category] = max(worst.get(category, 0.0), latency)
            if not ok or latency > HEALTH_BOUND_S:
                self.tally.failed("stalls", f"/health at {url} took {latency:.1f} s (ok={ok})", category)


def _poll(urls: list[str], queue, stop) -> None:
    with httpx.Client(timeout=15.0) as client:
        while not stop.wait(0.25):
            for url in urls:
                start = time.monotonic()
                try:
                    ok = client.get(f"{url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                queue.put((url, time.monotonic() - start, ok))
