"""Adapter sources for the background-load tests, in a module of their own so loader processes can
unpickle them without importing a test module."""

from __future__ import annotations

import time
from pathlib import Path


class FolderSource:
    """Adapter id = a folder's name under `root` ("hang": a load that never ends); records what it loaded,
    as a store's observer would."""

    def __init__(self, root: Path):
        self.root = root
        self.records: list = []
        self.replayed: list = []

    def resolve(self, ref: str) -> str:
        return ref

    def load(self, adapter_id: str, read):
        self.records.append(("loaded", adapter_id))
        if adapter_id == "hang":
            time.sleep(600)
        return read(self.root / adapter_id)

    def drain(self) -> list:
        records, self.records = self.records, []
        return records

    def replay(self, records: list) -> None:
        self.replayed.extend(records)


class UnpicklableSource(FolderSource):
    def __reduce__(self):
        raise TypeError("holds a live connection")
