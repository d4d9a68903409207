"""`rstar worker --queues ...`: a Celery worker of the `hosts` profile.

It is dagster-celery's worker (the app and task the Celery executor sends steps to),
started with the broker and result backend of the profile (RSTAR_CELERY_BROKER,
RSTAR_CELERY_BACKEND) and the queues this host can serve: a GPU host `llm,gpu`, a CPU
host `sandbox,dagster` (`dagster` holds the steps in no pool).
"""

from __future__ import annotations

import os
import socket

from rstar_pipelines.deployment import BACKEND_ENV, BROKER_ENV


def worker_app():
    """dagster-celery's app with the profile's broker and backend, its task registered."""
    from dagster_celery.executor import CeleryExecutor
    from dagster_celery.make_app import make_app
    from dagster_celery.tasks import create_task

    broker = os.environ.get(BROKER_ENV)
    if not broker:
        raise ValueError(f"{BROKER_ENV} is not set: the broker URL, e.g. redis://host:6379/0")
    backend = os.environ.get(BACKEND_ENV) or broker
    app = make_app(CeleryExecutor.for_cli(broker=broker, backend=backend).app_args())
    create_task(app)
    return app


def worker_argv(queues: list[str], concurrency: int, name: str | None) -> list[str]:
    return [
        "worker",
        "--queues",
        ",".join(queues),
        "--concurrency",
        str(concurrency),
        "--hostname",
        f"{name or 'rstar'}@{socket.gethostname()}",
        "--loglevel",
        "INFO",
        # One step at a time per process: a long step must not hold others it prefetched.
        "--prefetch-multiplier",
        "1",
        "--without-gossip",
        "--without-mingle",
    ]


def run_worker(queues: list[str], concurrency: int, name: str | None = None) -> None:
    """Serve `queues` until stopped (each step names its run's instance: no DAGSTER_HOME
    is needed, but RSTAR_POSTGRES_URL is, as the instance config reads it)."""
    worker_app().worker_main(worker_argv(queues, concurrency, name))
