"""The contract between the declared pipeline and the code that computes an asset.

A stage kind is a class named in `pipeline.yaml`. It validates its own parameters,
states the Arrow schema of each table it writes, and computes plain tables from plain
tables. It knows nothing of Dagster: the asset factory adapts it, and tests can call
`run` directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict


class StageInputError(ValueError):
    """The stage's input is unusable as a whole (a missing or unreadable file, say).
    Reported as a plain failure naming what was wrong, not as a crash with a trace."""


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageParams(BaseModel):
    """Base for a stage's declared parameters: unknown keys are errors, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class StageContext:
    """What a stage may use while it runs."""

    partition_key: str | None
    log: logging.Logger
    resources: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None

    def resource(self, name: str) -> Any:
        try:
            return self.resources[name]
        except KeyError:
            raise KeyError(f"stage needs resource {name!r}, which was not provided") from None


@dataclass
class StageResult:
    """The tables a stage produced: `table` for the asset itself, `secondary` for the
    extra outputs it declares, and metadata shown on the asset's materialization."""

    table: pa.Table
    secondary: dict[str, pa.Table] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


class Stage:
    """Base of every stage kind.

    Subclasses set:
      Params             pydantic model of the `params:` block
      schema             Arrow schema of the asset's table
      secondary_outputs  name -> schema of the extra tables it writes (mapped to
                         asset keys by `outputs:` in pipeline.yaml)
      prompt_roles       prompt template roles the stage renders (mapped to files by
                         `prompts:` in pipeline.yaml)
      resources          Dagster resource keys it needs
      kinds              tags shown as icons in the Dagster UI
      version            bump when a change to the code changes what it produces
    """

    Params: ClassVar[type[BaseModel]] = NoParams
    schema: ClassVar[pa.Schema]
    secondary_outputs: ClassVar[dict[str, pa.Schema]] = {}
    prompt_roles: ClassVar[tuple[str, ...]] = ()
    resources: ClassVar[tuple[str, ...]] = ()
    kinds: ClassVar[frozenset[str]] = frozenset({"python"})
    version: ClassVar[str] = "1"

    def __init__(self, params: BaseModel, prompts: dict[str, Any] | None = None):
        self.params = params
        self.prompts = prompts or {}

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        raise NotImplementedError
