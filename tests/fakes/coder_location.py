"""A code location of the declared pipeline with the scripted coder model and the process
sandbox, under the deployment profile of RSTAR_DEPLOYMENT (Celery workers import it by module
name): what the scale-out tests and benchmark materialize."""

import subprocess
import sys
from pathlib import Path

import dagster as dg

from rstar_pipelines.definitions import build_definitions
from rstar_pipelines.sandbox_resource import SandboxResource
from tests.fakes.coder import CODER, scripted_spec
from tests.fakes.llm import ScriptedLLMResource
from tests.fakes.repo import IN_PROCESS_RUN, REPO

__all__ = ["defs", "materialize", "scripted_definitions"]


def scripted_definitions() -> dg.Definitions:
    base = build_definitions(scripted_spec())
    return dg.Definitions(
        assets=base.assets,
        resources={
            **base.resources,
            "llm": ScriptedLLMResource.serving(CODER, key="coder"),
            "sandbox": SandboxResource(backend="process", workers=2),
        },
        executor=base.executor,
    )


defs = scripted_definitions()


def materialize(
    env: dict, selection: list[str], batch: str, in_process: bool = False
) -> subprocess.Popen:
    """`dagster asset materialize` of this code location in a process of its own (the
    profile is the one `env` sets; `in_process`: every step in that process, under the
    local profile's executor); its output in `.stdout`."""
    dagster = str(Path(sys.executable).parent / "dagster")
    config = ["--config-json", IN_PROCESS_RUN] if in_process else []
    return subprocess.Popen(
        [dagster, "asset", "materialize", "--select", ",".join(selection), "--partition", batch,
         "-m", __name__, *config],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
