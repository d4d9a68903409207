"""The declared pipeline (assets/pipeline.yaml): schema, validation and loading.

Every error names the file, the asset key and the field, because the file is the
user's interface to the graph and a bad edit must point at itself.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_pipelines.pipeline.stage import Stage

PARTITIONINGS = ("seed_batches", "none")
AssetKeyStr = Field(pattern=r"^[a-z][a-z0-9_]*$")


class PipelineSpecError(ValueError):
    """A pipeline.yaml that cannot be loaded; the message says where."""


class AssetDecl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str = AssetKeyStr
    stage: str
    group: str
    description: str = ""
    upstream: list[str] = []
    partitioning: Literal["seed_batches", "none"] = "none"
    pool: str | None = None
    # "eager": re-run when upstream updates; "none": only when asked (sensor, CLI, UI).
    automation: Literal["eager", "none"] | None = None
    outputs: dict[str, str] = {}
    prompts: dict[str, str] = {}
    params: dict[str, Any] = {}


class PipelineFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    # Model roles (synthesizer, solver, ...) -> a model id for the llm resource's backend;
    # null means the resource's default (RSTAR_LLM_MODEL, else the embedded model).
    models: dict[str, str | None] = {}
    assets: list[AssetDecl]


class DeclaredAsset:
    """One validated entry: its stage class, typed params and loaded prompt templates."""

    def __init__(
        self,
        decl: AssetDecl,
        stage_cls: type[Stage],
        params: BaseModel,
        prompts: dict[str, PromptTemplate],
        model: str | None = None,
    ):
        self.decl = decl
        self.stage_cls = stage_cls
        self.params = params
        self.prompts = prompts
        self.model = model

    @property
    def key(self) -> str:
        return self.decl.key

    @property
    def partitioned(self) -> bool:
        return self.decl.partitioning != "none"

    def output_keys(self) -> list[str]:
        return [self.decl.key, *self.decl.outputs.values()]

    def stage(self) -> Stage:
        return self.stage_cls(self.params, self.prompts, self.model)

    @property
    def code_version(self) -> str:
        """Changes whenever what the asset computes may change: the stage kind and its
        version, the declared parameters and model, and the text of each prompt template."""
        basis = {
            "stage": self.decl.stage,
            "stage_version": self.stage_cls.version,
            "params": self.params.model_dump(mode="json"),
            "model": self.model,
            "prompts": {role: t.sha256 for role, t in sorted(self.prompts.items())},
        }
        blob = json.dumps(basis, sort_keys=True).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()[:16]


class PipelineSpec:
    def __init__(self, path: Path, assets: list[DeclaredAsset]):
        self.path = path
        self.assets = assets
        self.by_key = {a.key: a for a in assets}

    def producer_of(self, key: str) -> DeclaredAsset:
        for asset in self.assets:
            if key in asset.output_keys():
                return asset
        raise KeyError(key)

    def schema_of(self, key: str) -> pa.Schema:
        producer = self.producer_of(key)
        if key == producer.key:
            return producer.stage_cls.schema
        output = next(name for name, k in producer.decl.outputs.items() if k == key)
        return producer.stage_cls.secondary_outputs[output]

    def with_stage(self, stage_cls: type[Stage]) -> list[DeclaredAsset]:
        return [a for a in self.assets if a.stage_cls is stage_cls]


def _where(path: Path, key: str | None, field: str | None) -> str:
    parts = [str(path)]
    if key:
        parts.append(f"asset {key!r}")
    if field:
        parts.append(f"field {field!r}")
    return ": ".join(parts)


def _fail(path: Path, key: str | None, field: str | None, message: str) -> PipelineSpecError:
    return PipelineSpecError(f"{_where(path, key, field)}: {message}")


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def load_pipeline(path: Path, stages: dict[str, type[Stage]], prompts_dir: Path) -> PipelineSpec:
    """Parse, validate and resolve a pipeline file against the known stage kinds."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineSpecError(f"{path}: pipeline file not found") from None
    except yaml.YAMLError as err:
        raise PipelineSpecError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise _fail(path, None, None, "expected a mapping with an 'assets' list")

    try:
        parsed = PipelineFile.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        loc = first["loc"]
        key = None
        if len(loc) >= 2 and loc[0] == "assets" and isinstance(loc[1], int):
            entries = raw["assets"]
            entry = entries[loc[1]] if isinstance(entries[loc[1]], dict) else {}
            key = entry.get("key") or f"#{loc[1] + 1}"
            loc = loc[2:]
        raise _fail(path, key, _loc(loc) or None, first["msg"]) from None

    produced: dict[str, str] = {}
    declared: list[DeclaredAsset] = []
    for decl in parsed.assets:
        stage_cls = stages.get(decl.stage)
        if stage_cls is None:
            raise _fail(
                path,
                decl.key,
                "stage",
                f"unknown stage kind {decl.stage!r}; known: {', '.join(sorted(stages))}",
            )
        for out_key in [decl.key, *decl.outputs.values()]:
            if out_key in produced:
                raise _fail(
                    path,
                    decl.key,
                    "key" if out_key == decl.key else "outputs",
                    f"asset key {out_key!r} is already produced by {produced[out_key]!r}",
                )
            produced[out_key] = decl.key
        missing = set(stage_cls.secondary_outputs) - set(decl.outputs)
        extra = set(decl.outputs) - set(stage_cls.secondary_outputs)
        if missing or extra:
            raise _fail(
                path,
                decl.key,
                "outputs",
                f"stage {decl.stage} writes outputs {sorted(stage_cls.secondary_outputs)}; "
                f"map exactly those to asset keys (missing {sorted(missing)}, "
                f"unknown {sorted(extra)})",
            )
        try:
            params = stage_cls.Params.model_validate(decl.params)
        except ValidationError as err:
            first = err.errors()[0]
            raise _fail(path, decl.key, _loc(("params", *first["loc"])), first["msg"]) from None
        roles = set(stage_cls.prompt_roles)
        if set(decl.prompts) != roles:
            raise _fail(
                path,
                decl.key,
                "prompts",
                f"stage {decl.stage} needs prompt templates for roles {sorted(roles)}, "
                f"got {sorted(decl.prompts)}",
            )
        prompts = {}
        for role, name in decl.prompts.items():
            try:
                prompts[role] = PromptTemplate.load(prompts_dir, name)
            except FileNotFoundError:
                raise _fail(
                    path,
                    decl.key,
                    f"prompts.{role}",
                    f"template {name!r} not found in {prompts_dir}",
                ) from None
        model = None
        role = getattr(params, "model", None)
        if role is not None:
            if role not in parsed.models:
                raise _fail(
                    path,
                    decl.key,
                    "params.model",
                    f"unknown model role {role!r}; the models section declares "
                    f"{sorted(parsed.models)}",
                )
            model = parsed.models[role]
        declared.append(DeclaredAsset(decl, stage_cls, params, prompts, model))

    for asset in declared:
        for up in asset.decl.upstream:
            if up not in produced:
                raise _fail(path, asset.key, "upstream", f"unknown upstream asset {up!r}")
            if up in asset.output_keys():
                raise _fail(path, asset.key, "upstream", "an asset cannot depend on itself")
    _check_acyclic(path, declared, produced)
    return PipelineSpec(path, declared)


def _check_acyclic(path: Path, declared: list[DeclaredAsset], produced: dict[str, str]) -> None:
    deps = {a.key: {produced[u] for u in a.decl.upstream} for a in declared}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(key: str, trail: list[str]) -> None:
        if state.get(key) == 2:
            return
        if state.get(key) == 1:
            cycle = " -> ".join([*trail[trail.index(key) :], key])
            raise _fail(path, key, "upstream", f"dependency cycle: {cycle}")
        state[key] = 1
        for dep in sorted(deps[key]):
            visit(dep, [*trail, key])
        state[key] = 2

    for key in deps:
        visit(key, [])
