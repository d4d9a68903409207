"""Real servers for the scale-out tests, on loopback and free ports, stopped afterwards:
Postgres and Redis (Debian's), `rstar sandbox serve`, haproxy, Celery workers.

A server binary missing here skips its tests with the reason; in CI (`CI` set, where
.ci/run installs them) it fails them instead.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.repo import REPO

BIN = Path(sys.executable).parent
POSTGRES_BIN = Path("/usr/lib/postgresql/15/bin")


def require(binary: str) -> str:
    path = shutil.which(binary) or (
        str(POSTGRES_BIN / binary) if (POSTGRES_BIN / binary).exists() else None
    )
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the scale-out tests, but {binary} is not installed")
        pytest.skip(f"{binary} is not installed (apt-get install postgresql redis-server haproxy)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready, what: str, timeout_s: float = 60.0, proc=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not come up within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM its process group, then SIGKILL if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A throwaway Postgres 15 cluster; yields the SQLAlchemy URL (psycopg2 driver) of its
    `postgres` database (tests make their own with `new_database`)."""
    initdb, pg_ctl = require("initdb"), require("pg_ctl")
    root = Path(tempfile.mkdtemp(prefix="rstar-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # Postgres refuses to run as root
        account = pwd.getpwnam("postgres")
        os.chown(root, account.pw_uid, account.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", free_port()
    subprocess.run(
        [*as_user, initdb, "-A", "trust", "-U", "dagster", "-D", str(data)],
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c max_connections=200"
    subprocess.run(
        [*as_user, pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql+psycopg2://dagster@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
            check=False,
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def redis() -> Iterator[str]:
    """A Redis server without persistence; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [require("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: socket.create_connection(("127.0.0.1", port)).close() is None,
            "redis",
            proc=proc,
        )
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(proc)


def sandbox_service(*args: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`rstar sandbox serve` (process backend) in its own session; its URL once healthy."""
    port = port or free_port()
    proc = subprocess.Popen(
        [
            str(BIN / "rstar"),
            "sandbox",
            "serve",
            "--port",
            str(port),
            "--backend",
            "process",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, "sandbox service", proc=proc)
    return proc, url


HAPROXY_CONFIG = """
global
    maxconn 2048
defaults
    mode http
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    # A backend that refuses the connection: try again, the last time on another one.
    retries 3
    option redispatch
frontend sandbox
    bind 127.0.0.1:{port}
    default_backend services
backend services
    # The same batch id goes to the same service while it is up: a retry is answered
    # from the run already made there, never run twice.
    balance hdr(X-Rstar-Batch)
    hash-type consistent
    option httpchk GET /health
    http-check expect status 200
    default-server inter 200ms fall 2 rise 2
{servers}
"""


@contextlib.contextmanager
def haproxy(backends: list[str]) -> Iterator[str]:
    """Debian's haproxy in front of `backends` (host:port); yields its URL."""
    port = free_port()
    servers = "\n".join(f"    server s{i} {b} check" for i, b in enumerate(backends))
    with tempfile.NamedTemporaryFile("w", suffix=".cfg", delete=False) as cfg:
        cfg.write(HAPROXY_CONFIG.format(port=port, servers=servers))
    proc = subprocess.Popen(
        [require("haproxy"), "-db", "-f", cfg.name],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, "haproxy", proc=proc)
        yield url
    finally:
        stop(proc)
        os.unlink(cfg.name)


def new_database(url: str) -> str:
    """A fresh, empty database on the server of `url` (one per test: no shared history)."""
    import uuid

    import psycopg2

    name = f"t{uuid.uuid4().hex[:12]}"
    conn = psycopg2.connect(url.replace("+psycopg2", ""))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    conn.close()
    return url.rsplit("/", 1)[0] + f"/{name}"


def celery_worker(env: dict, name: str, queues: str, log: Path | None = None) -> subprocess.Popen:
    """`rstar worker` (the `hosts` profile's Celery worker) serving `queues`, from the
    repository root so that it imports the tests' code location."""
    return subprocess.Popen(
        [str(BIN / "rstar"), "worker", "--queues", queues, "--name", name],
        env=env,
        cwd=REPO,
        stdout=log.open("w") if log else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
