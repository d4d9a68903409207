"""Where item caches keep their entries: a SQLite file per asset partition, or Postgres.

Two runs that share a SQLite file contend for its write lock, and a file on a network
filesystem is worse (SQLite's locks are not safe over NFS). So each partition of an
asset gets a file of its own (runs of two partitions, on one host or two, never share
one), or every host writes one Postgres table, which takes concurrent writers as they
come: RSTAR_ITEM_CACHE_URL=postgresql://... (the deployment profiles `hosts` and `k8s`
use the instance's database).
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from rstar_pipelines import settings

CACHE_URL_ENV = "RSTAR_ITEM_CACHE_URL"
POSTGRES_TABLE = "rstar_item_cache"


def cache_url() -> str | None:
    """RSTAR_ITEM_CACHE_URL, else (profiles hosts and k8s) the instance's Postgres."""
    if os.environ.get(CACHE_URL_ENV):
        return os.environ[CACHE_URL_ENV]
    return settings.postgres_url() if settings.deployment() != "local" else None


def cache_location(asset_key: str, partition_key: str | None) -> Path | str:
    """The cache of one asset partition: `<cache_url()>#<asset>` when there is a Postgres
    database for it, else `<data dir>/cache/<asset>/<partition>.sqlite`
    (`<asset>.sqlite` for an unpartitioned asset)."""
    url = cache_url()
    if url:
        if not is_postgres(url):
            raise ValueError(f"{CACHE_URL_ENV} must be a postgresql:// URL, got {url!r}")
        return f"{url}#{asset_key}"
    root = settings.data_dir() / "cache"
    if partition_key is None:
        return root / f"{asset_key}.sqlite"
    return root / asset_key / f"{quote(partition_key, safe='')}.sqlite"


def is_postgres(location: str | os.PathLike) -> bool:
    return isinstance(location, str) and re.match(r"postgres(ql)?(\+\w+)?://", location) is not None


class SQLiteStore:
    """One file (WAL: readers never wait for the writer). Threads of one stage may share it
    (searches side by side): one statement or transaction at a time on its connection."""

    # Two threads opening one new file at once: the second's switch to WAL fails at once with
    # "database is locked" (SQLite does not wait on that lock), so opening is one at a time.
    _opening = threading.Lock()

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, timeout=60, check_same_thread=False)
        self._lock = threading.Lock()
        with self._opening:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS items "
                "(fingerprint TEXT PRIMARY KEY, value TEXT NOT NULL)"
            )

    def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        found = {}
        with self._lock:
            for key in keys:
                row = self._db.execute(
                    "SELECT value FROM items WHERE fingerprint = ?", (key,)
                ).fetchone()
                if row is not None:
                    found[key] = row[0]
        return found

    def put(self, key: str, value: str) -> None:
        with self._lock, self._db:  # one transaction per item: committed before the next starts
            self._db.execute(
                "INSERT OR REPLACE INTO items (fingerprint, value) VALUES (?, ?)", (key, value)
            )

    def close(self) -> None:
        self._db.close()


class PostgresStore:
    """One table for every asset, keyed by (namespace, fingerprint): `url#namespace`."""

    def __init__(self, location: str):
        import psycopg2

        url, _, self.namespace = location.partition("#")
        if not self.namespace:
            raise ValueError(f"a Postgres item cache location ends in #<asset>: {location!r}")
        # SQLAlchemy-style URLs name the driver (postgresql+psycopg2://): libpq does not.
        self._db = psycopg2.connect(re.sub(r"^postgres(ql)?\+\w+://", "postgresql://", url))
        self._lock = threading.Lock()
        with self._lock, self._db, self._db.cursor() as cur:
            # Concurrent CREATE TABLE IF NOT EXISTS can still collide: take a lock first.
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (zlib.crc32(POSTGRES_TABLE.encode()),))
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {POSTGRES_TABLE} (namespace TEXT NOT NULL, "
                "fingerprint TEXT NOT NULL, value TEXT NOT NULL, "
                "PRIMARY KEY (namespace, fingerprint))"
            )

    def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        if not keys:
            return {}
        with self._lock, self._db, self._db.cursor() as cur:
            cur.execute(
                f"SELECT fingerprint, value FROM {POSTGRES_TABLE} "
                "WHERE namespace = %s AND fingerprint = ANY(%s)",
                (self.namespace, list(keys)),
            )
            return dict(cur.fetchall())

    def put(self, key: str, value: str) -> None:
        with self._lock, self._db, self._db.cursor() as cur:  # committed on leaving
            cur.execute(
                f"INSERT INTO {POSTGRES_TABLE} (namespace, fingerprint, value) "
                "VALUES (%s, %s, %s) ON CONFLICT (namespace, fingerprint) "
                "DO UPDATE SET value = EXCLUDED.value",
                (self.namespace, key, value),
            )

    def close(self) -> None:
        self._db.close()


def open_store(location: str | os.PathLike) -> SQLiteStore | PostgresStore:
    if is_postgres(location):
        return PostgresStore(str(location))
    return SQLiteStore(Path(location))
