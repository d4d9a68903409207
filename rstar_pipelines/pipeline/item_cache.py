"""Item-level cache: completed work items of an asset, keyed by fingerprint.

Every item (one problem's completions, one problem's verification, ...) is committed
as soon as it is done, so re-materializing a partition after a crash or a parameter
change redoes only the items whose fingerprint changed or that were in flight.
A fingerprint covers everything the item's result depends on: its inputs, the
prompt, the model and the parameters.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rstar_pipelines.pipeline import progress

T = TypeVar("T")


def fingerprint(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ItemCache:
    """A small SQLite table per asset (WAL, so runs of other partitions can share it)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, timeout=60, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS items (fingerprint TEXT PRIMARY KEY, value TEXT NOT NULL)"
        )
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Any | None:
        row = self._db.execute("SELECT value FROM items WHERE fingerprint = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, value: Any) -> None:
        with self._db:  # one transaction per item: committed before the next starts
            self._db.execute(
                "INSERT OR REPLACE INTO items (fingerprint, value) VALUES (?, ?)",
                (key, json.dumps(value, ensure_ascii=False)),
            )

    def map(
        self,
        items: Sequence[T],
        key: Callable[[T], str],
        compute: Callable[[list[T]], Iterable[Any]],
        chunk: int,
    ) -> list[Any]:
        """Results for `items` in order: cached ones as stored, the rest computed
        `chunk` at a time (one LLM or sandbox batch) and committed per chunk."""
        keys = [key(item) for item in items]
        results: list[Any] = [self.get(k) for k in keys]
        todo = [i for i, r in enumerate(results) if r is None]
        self.hits += len(items) - len(todo)
        self.misses += len(todo)
        with progress.track(len(todo), cached=len(items) - len(todo)) as task:
            for start in range(0, len(todo), chunk):
                batch = todo[start : start + chunk]
                for i, value in zip(batch, compute([items[i] for i in batch]), strict=True):
                    self.put(keys[i], value)
                    results[i] = value
                if task is not None:
                    task.advance(len(batch))
        return results

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def close(self) -> None:
        self._db.close()
