"""Where the project finds its declared pipeline and keeps its data.

Resolved at call time, not import time, so tests and users can point the
environment variables elsewhere without reloading modules.
"""

from __future__ import annotations

import os
from pathlib import Path

from upath import UPath

REPO_ROOT = Path(__file__).resolve().parent.parent

DATA_DIR_ENV = "RSTAR_DATA_DIR"
ASSETS_DIR_ENV = "RSTAR_ASSETS_DIR"
LAKE_URL_ENV = "RSTAR_LAKE_URL"
DEPLOYMENT_ENV = "RSTAR_DEPLOYMENT"
DEPLOYMENTS = ("local", "hosts", "k8s")
POSTGRES_URL_ENV = "RSTAR_POSTGRES_URL"


def data_dir() -> Path:
    """Root of everything a run writes: the Parquet lake, incoming seeds, checkpoints."""
    return Path(os.environ.get(DATA_DIR_ENV, "data")).resolve()


def lake_dir() -> UPath:
    """Where the Parquet lake lives: RSTAR_LAKE_URL (any fsspec URL: an NFS path,
    s3://bucket/lake, ...), else `<data dir>/lake`."""
    url = os.environ.get(LAKE_URL_ENV)
    return UPath(url) if url else UPath(data_dir() / "lake")


def assets_dir() -> Path:
    """The declared pipeline: pipeline.yaml, prompt templates, demo seeds."""
    return Path(os.environ.get(ASSETS_DIR_ENV, REPO_ROOT / "assets")).resolve()


def pipeline_file() -> Path:
    return assets_dir() / "pipeline.yaml"


def prompts_dir() -> Path:
    return assets_dir() / "prompts"


def resolve_data_path(path: str | Path) -> Path:
    """A declared path: absolute as given, relative ones under the data directory."""
    path = Path(path)
    return path if path.is_absolute() else data_dir() / path


def deployment() -> str:
    """The deployment profile (docs/scale-out.md): local (the default), hosts or k8s."""
    name = os.environ.get(DEPLOYMENT_ENV, "local")
    if name not in DEPLOYMENTS:
        raise ValueError(f"{DEPLOYMENT_ENV}={name!r}: use one of {', '.join(DEPLOYMENTS)}")
    return name


def postgres_url() -> str | None:
    """The Postgres database of the `hosts` and `k8s` profiles (SQLAlchemy URL)."""
    return os.environ.get(POSTGRES_URL_ENV) or None
