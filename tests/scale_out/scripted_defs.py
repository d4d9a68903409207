"""The code location of the scale-out tests and benchmark: the declared pipeline with
the scripted model of tests/coder/test_chain_scripted.py and the process sandbox, under
the deployment profile of RSTAR_DEPLOYMENT (Celery workers import it by module name)."""

import dagster as dg

from rstar_pipelines.definitions import build_definitions
from rstar_pipelines.sandbox_resource import SandboxResource
from tests.coder.test_chain_scripted import CHAIN, ScriptedLLMResource, scripted_spec

__all__ = ["CHAIN", "defs", "scripted_definitions"]


def scripted_definitions() -> dg.Definitions:
    base = build_definitions(scripted_spec())
    return dg.Definitions(
        assets=base.assets,
        resources={
            **base.resources,
            "llm": ScriptedLLMResource(),
            "sandbox": SandboxResource(backend="process", workers=2),
        },
        executor=base.executor,
    )


defs = scripted_definitions()
