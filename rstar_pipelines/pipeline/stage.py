"""The contract between the declared pipeline and the code that computes an asset.

A stage kind is a class named in `pipeline.yaml`. It validates its own parameters,
states the Arrow schema of each table it writes, and computes plain tables from plain
tables. It knows nothing of Dagster: the asset factory adapts it, and tests can call
`run` directly.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from rstar_pipelines.pipeline.item_cache import ItemCache


class Markdown(str):
    """Metadata text to render as Markdown in the UI (tables, inlined plots)."""


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
    cache_path: Path | str | None = None  # a SQLite file, or postgresql://...#<asset>
    cache_namespace: str = ""  # Stage.cache_namespace() of the stage that runs
    # Runs a command out of this process; the asset factory sets one that goes through
    # Dagster Pipes (the run's logs show its messages, cancelling the run stops it).
    launcher: Callable[[list[str]], None] | None = None
    _cache: ItemCache | None = field(default=None, init=False, repr=False)

    @property
    def cache(self) -> ItemCache:
        """The asset's item cache, opened on first use (stages that cache nothing
        leave no file behind)."""
        if self._cache is None:
            if self.cache_path is None:
                raise RuntimeError("this stage context has no item cache")
            self._cache = ItemCache(self.cache_path, self.cache_namespace)
        return self._cache

    def cache_metadata(self) -> dict[str, Any]:
        """How much of the work came from the item cache (nothing if it was not used)."""
        if self._cache is None:
            return {}
        c = self._cache
        return {"cache_hits": c.hits, "cache_misses": c.misses, "cache_hit_rate": c.hit_rate}

    def serving_metadata(self) -> dict[str, Any]:
        """How the LLM servers the stage used were kept busy (`llm_servers`: the window each
        settled at, requests, sequences, tokens/s, retries); nothing without a server fleet."""
        llm = self.resources.get("llm")
        table = llm.servers_table() if hasattr(llm, "servers_table") else None
        return {"llm_servers": Markdown(table)} if table else {}

    def run_process(self, command: list[str]) -> None:
        """Run heavy work (training) in its own process, so that a crash or an
        out-of-memory kill there fails this stage instead of taking the run down."""
        if self.launcher is not None:
            self.launcher(command)
        else:
            subprocess.run(command, check=True)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()

    def resource(self, name: str) -> Any:
        try:
            return self.resources[name]
        except KeyError:
            raise KeyError(f"stage needs resource {name!r}, which was not provided") from None


@dataclass(frozen=True)
class CheckSpec:
    """A data-quality check the stage evaluates on what it produced. A failed blocking
    check stops the run's downstream steps (the asset itself is still recorded). A
    warning (`warn=True`, never blocking) shows on the asset without failing anything:
    for a result that is usable but not what was asked for (a training that made no
    update)."""

    name: str
    description: str
    blocking: bool = True
    warn: bool = False

    def __post_init__(self) -> None:
        if self.warn and self.blocking:
            raise ValueError(f"check {self.name!r}: a warning never blocks")


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageResult:
    """The tables a stage produced: `table` for the asset itself, `secondary` for the
    extra outputs it declares, metadata shown on the asset's materialization, and the
    outcome of each declared check."""

    table: pa.Table
    secondary: dict[str, pa.Table] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    checks: list[CheckOutcome] = field(default_factory=list)


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
      checks             the checks its run reports on (CheckSpec)
      kinds              tags shown as icons in the Dagster UI
      pairs_upstream     True where the stage pairs its upstream evaluations problem by
                         problem: the loader then requires them to declare one
                         max_problems, since the pairs cover only the problems all share
      version            bump it whenever a change to the code changes what the stage
                         produces from the same inputs and parameters, including code it
                         calls (the search engine, a parser, a prompt renderer): the
                         version is part of every item-cache key of the stage and of the
                         asset's code version, so a bump redoes its cached items and marks
                         it and everything downstream stale. No bump for a change that
                         only adds metadata or renames nothing stored.

    A stage whose params have a `model` field names a role of the pipeline's
    `models:` section; it receives the model that role resolves to as `self.model`
    (None: the llm resource's default).
    """

    Params: ClassVar[type[BaseModel]] = NoParams
    schema: ClassVar[pa.Schema]
    secondary_outputs: ClassVar[dict[str, pa.Schema]] = {}
    prompt_roles: ClassVar[tuple[str, ...]] = ()
    resources: ClassVar[tuple[str, ...]] = ()
    checks: ClassVar[tuple[CheckSpec, ...]] = ()
    kinds: ClassVar[frozenset[str]] = frozenset({"python"})
    pairs_upstream: ClassVar[bool] = False
    version: ClassVar[str] = "1"

    def __init__(
        self, params: BaseModel, prompts: dict[str, Any] | None = None, model: str | None = None
    ):
        self.params = params
        self.prompts = prompts or {}
        self.model = model

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        raise NotImplementedError

    @classmethod
    def cache_namespace(cls) -> str:
        """What every item-cache key of this stage kind carries: its name and version."""
        return f"{cls.__name__}@{cls.version}"


def rows_of(table: pa.Table, domain: str | None = None) -> list[dict[str, Any]]:
    """A table's rows as dicts, optionally only those of one domain."""
    rows = table.to_pylist()
    return rows if domain is None else [r for r in rows if r["domain"] == domain]
