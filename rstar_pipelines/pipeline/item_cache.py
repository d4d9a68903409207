"""Item-level cache: completed work items of an asset, keyed by fingerprint.

Every item (one problem's completions, one problem's verification, ...) is committed
as soon as it is done, so re-materializing a partition after a crash or a parameter
change redoes only the items whose fingerprint changed or that were in flight.

A key has two parts. The stage's fingerprint of the item covers the data its result depends on:
its inputs, the prompt, the model and the parameters it uses. The cache's namespace covers the
code: the stage kind and its `version` (pipeline/stage.py), mixed into every key here, in one
place, so that bumping a stage's version after a change to what its code computes redoes every
item of that stage, and no other stage's. Where the entries live (a SQLite file per asset
partition, or Postgres) is cache_store's business.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, TypeVar

from rstar_pipelines import progress
from rstar_pipelines.pipeline.cache_store import open_store

T = TypeVar("T")


def fingerprint(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ItemCache:
    """A stage's completed items at `location` (a SQLite file path, or
    `postgresql://...#<asset>`: see cache_store), under `namespace`."""

    def __init__(self, location: str | os.PathLike, namespace: str):
        if not namespace:
            raise ValueError("an item cache needs a namespace: the stage kind and its version")
        self.location = location
        self.namespace = namespace
        self._store = open_store(location)
        self.hits = 0
        self.misses = 0
        self._counting = threading.Lock()  # searches side by side share the cache

    def _stored_key(self, key: str) -> str:
        return fingerprint(self.namespace, key)

    def get(self, key: str) -> Any | None:
        """The value stored for the item fingerprint `key` by this namespace, or None."""
        stored = self._stored_key(key)
        value = self._store.get_many([stored]).get(stored)
        return None if value is None else json.loads(value)

    def _count(self, hits: int, misses: int) -> None:
        with self._counting:
            self.hits += hits
            self.misses += misses

    def put(self, key: str, value: Any) -> None:
        self._store.put(self._stored_key(key), json.dumps(value, ensure_ascii=False))

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
        stored_keys = [self._stored_key(k) for k in keys]
        stored = self._store.get_many(stored_keys)
        results: list[Any] = [json.loads(stored[s]) if s in stored else None for s in stored_keys]
        todo = [i for i, r in enumerate(results) if r is None]
        self._count(len(items) - len(todo), len(todo))
        with progress.track(len(todo), cached=len(items) - len(todo)) as task:
            for start in range(0, len(todo), chunk):
                batch = todo[start : start + chunk]
                for i, value in zip(batch, compute([items[i] for i in batch]), strict=True):
                    self.put(keys[i], value)
                    results[i] = value
                if task is not None:
                    task.advance(len(batch))
        return results

    def map_streamed(
        self,
        items: Sequence[T],
        key: Callable[[T], str],
        compute: Callable[[list[T], Callable[[int, Any], None]], None],
    ) -> list[Any]:
        """Results for `items` in order, as `map`, but without batches: `compute(missing, done)`
        computes the missing items in any order it likes and calls `done(j, value)`, from the
        calling thread, as soon as `missing[j]` is finished; each value is committed then,
        whatever the others do. Items with the same key are computed once. If `compute`
        raises, what it finished stays committed."""
        keys = [key(item) for item in items]
        stored_keys = [self._stored_key(k) for k in keys]
        stored = self._store.get_many(stored_keys)
        results: list[Any] = [json.loads(stored[s]) if s in stored else None for s in stored_keys]
        waiting: dict[str, list[int]] = {}  # a missing key -> the items that have it
        for i, r in enumerate(results):
            if r is None:
                waiting.setdefault(keys[i], []).append(i)
        todo = list(waiting.values())
        missing = sum(len(same) for same in todo)
        self._count(len(items) - missing, missing)
        if not todo:
            return results
        with progress.track(len(todo), cached=len(items) - missing) as task:

            def done(j: int, value: Any) -> None:
                same = todo[j]
                if results[same[0]] is not None:
                    raise RuntimeError(f"item {same[0]} of {len(items)} was finished twice")
                for i in same:
                    results[i] = value
                self.put(keys[same[0]], value)
                if task is not None:
                    task.advance(1)

            compute([items[same[0]] for same in todo], done)
        unfinished = sum(1 for same in todo if results[same[0]] is None)
        if unfinished:
            raise RuntimeError(f"{unfinished} of {len(todo)} items were never finished")
        return results

    def map_async(
        self,
        items: Sequence[T],
        key: Callable[[T], str],
        submit: Callable[[list[T]], list[Future]],
        value: Callable[[Any], Any] = lambda result: result,
    ) -> list[Any]:
        """`map_streamed` over futures: the missing items are submitted at once (`submit`
        returns a future per item) and each is committed as soon as its future is done. On an
        error, the items not yet started are withdrawn, the ones running are awaited and
        committed, and the error is raised."""

        def compute(todo: list[T], done: Callable[[int, Any], None]) -> None:
            futures = submit(todo)
            index = {future: j for j, future in enumerate(futures)}
            pending, error = set(futures), None
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    if future.cancelled():
                        continue
                    if future.exception() is not None:
                        if error is None:
                            error = future.exception()
                            for other in pending:
                                other.cancel()
                        continue
                    done(index[future], value(future.result()))
            if error is not None:
                raise error

        return self.map_streamed(items, key, compute)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def close(self) -> None:
        self._store.close()
