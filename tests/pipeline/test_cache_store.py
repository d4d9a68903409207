"""The item cache's SQLite file opened by several threads of one stage at once (searches side by
side each open the stage's cache, and commit each tree as it ends)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from rstar_pipelines.pipeline.cache_store import SQLiteStore


def test_threads_open_and_write_one_new_file_at_once(tmp_path):
    for attempt in range(10):
        path = tmp_path / f"cache-{attempt}.sqlite"
        together = threading.Barrier(4)

        def open_and_write(i: int, path=path, together=together) -> None:
            together.wait()
            store = SQLiteStore(path)
            for k in range(50):
                store.put(f"{i}-{k}", "v")
            store.close()

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(open_and_write, range(4)))  # raises what a thread raised
        store = SQLiteStore(path)
        keys = [f"{i}-{k}" for i in range(4) for k in range(50)]
        assert len(store.get_many(keys)) == len(keys)
        store.close()
