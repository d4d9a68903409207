"""Deployment profiles: the same pipeline on one machine, on several hosts, or on
Kubernetes, chosen by one setting (RSTAR_DEPLOYMENT; docs/scale-out.md).

    local  today's: Dagster's default instance (SQLite under DAGSTER_HOME) and executor,
           the lake and item caches on this disk, the sandbox on this machine
    hosts  a Postgres instance, the Celery executor (Redis broker): each step goes to
           the queue of its pool and runs on a worker that serves it (`rstar worker`);
           the lake on a shared filesystem or object store, item caches in Postgres,
           the sandbox as services (`rstar sandbox serve`)
    k8s    the same with dagster-k8s: K8sRunLauncher, k8s_job_executor with a pod spec
           per pool (GPU requests for `gpu`), training pods through PipesK8sClient

The Dagster instance settings (storage, run queue, pool limits) are in
`templates/<profile>.yaml`, which `rstar deploy init` writes to DAGSTER_HOME.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import dagster as dg

from rstar_pipelines import settings

# dagster_celery.tags.DAGSTER_CELERY_QUEUE_TAG (not imported: Celery loads slowly).
CELERY_QUEUE_TAG = "dagster-celery/queue"
DEFAULT_QUEUE = "dagster"  # steps in no pool (the Celery executor's default queue)
BROKER_ENV = "RSTAR_CELERY_BROKER"
BACKEND_ENV = "RSTAR_CELERY_BACKEND"


def step_tags(pool: str | None) -> dict[str, str]:
    """Op tags of a step in `pool`: under Celery it goes to the queue named like its pool."""
    return {CELERY_QUEUE_TAG: pool} if pool else {}


def celery_config() -> dict:
    """The Celery executor's config, shared by the run (which sends steps) and the
    workers (which take them): broker and result backend from the environment."""
    backend = os.environ.get(BACKEND_ENV)
    return {
        "broker": {"env": BROKER_ENV},
        "backend": backend if backend else {"env": BROKER_ENV},
    }


def executor(pools: Mapping[str, str | None]) -> dg.ExecutorDefinition | None:
    """The profile's executor (None: Dagster's default, as `local` always had), for the steps
    of `pools` (each asset key -> its pool, `PipelineSpec.pools()`)."""
    profile = settings.deployment()
    if profile == "hosts":
        from dagster_celery import celery_executor

        return celery_executor.configured(celery_config(), name="celery")
    if profile == "k8s":
        from rstar_pipelines.deployment.k8s import step_executor

        return step_executor(pools)
    return None


def run_out_of_process(context: dg.AssetExecutionContext, command: list[str]) -> None:
    """Heavy work (training) through Dagster Pipes: a subprocess on the step's host, or
    (k8s) a pod with the `gpu` pool's pod spec."""
    if settings.deployment() == "k8s":
        from rstar_pipelines.deployment.k8s import run_training_pod

        run_training_pod(context, command)
    else:
        dg.PipesSubprocessClient().run(context=context, command=command)
