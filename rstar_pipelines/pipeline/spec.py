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

from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_pipelines.pipeline.stage import Stage

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
    # Self-evolution: a per-round asset is declared once and repeated for every round of
    # the file's `rounds`; round 1 keeps the key, round r >= 2 gets the suffix _r<r>.
    # Its upstream per-round assets are those of the same round; `previous_round` names
    # per-round assets it reads from round r-1 (from round 2 on); `later_rounds`
    # overrides params from round 2 on. The stage receives `round` among its params.
    per_round: bool = False
    previous_round: list[str] = []
    later_rounds: dict[str, Any] = {}


class PipelineFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    # Model roles (synthesizer, solver, ...) -> a model id for the llm resource's backend;
    # null means the resource's default (RSTAR_LLM_MODEL, else the embedded model).
    models: dict[str, str | None] = {}
    rounds: int = Field(1, ge=1, description="self-evolution rounds of the per-round assets")
    # The one held-out split: stages whose params have a `heldout` field receive it.
    heldout: HeldoutSplit = HeldoutSplit()
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
        input_names: dict[str, str] | None = None,
    ):
        self.decl = decl
        self.stage_cls = stage_cls
        self.params = params
        self.prompts = prompts
        self.model = model
        # upstream key -> the name the stage reads it by (a later round's assets read
        # their own round's inputs by the round-1 key, the previous round's as previous_<key>)
        self.input_names = input_names or {u: u for u in decl.upstream}

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

    def pools(self) -> dict[str, str | None]:
        """Each declared asset's key -> the pool its step runs in (None: no pool), what the
        deployment profiles need of the graph."""
        return {a.key: a.decl.pool for a in self.assets}

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


def round_key(key: str, round_: int) -> str:
    return key if round_ == 1 else f"{key}_r{round_}"


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` on top of `base`, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merged(merged[key], value)
        merged[key] = value
    return merged


def _expand_rounds(path: Path, parsed: PipelineFile) -> list[tuple[AssetDecl, dict[str, str]]]:
    """Every declared asset once per round it belongs to, with its input names."""
    per_round = {
        key: decl.key
        for decl in parsed.assets
        if decl.per_round
        for key in [decl.key, *decl.outputs.values()]
    }
    expanded = []
    for decl in parsed.assets:
        if not decl.per_round:
            if decl.previous_round or decl.later_rounds:
                raise _fail(
                    path,
                    decl.key,
                    "previous_round" if decl.previous_round else "later_rounds",
                    "only a per_round asset has rounds",
                )
            expanded.append((decl, {u: u for u in decl.upstream}))
            continue
        for key in decl.previous_round:
            if key not in per_round:
                raise _fail(path, decl.key, "previous_round", f"{key!r} is not a per_round asset")
        for r in range(1, parsed.rounds + 1):
            inputs = {round_key(u, r) if u in per_round else u: u for u in decl.upstream}
            if r > 1:
                inputs.update({round_key(k, r - 1): f"previous_{k}" for k in decl.previous_round})
            params = {**_merged(decl.params, decl.later_rounds if r > 1 else {}), "round": r}
            expanded.append(
                (
                    decl.model_copy(
                        update={
                            "key": round_key(decl.key, r),
                            "outputs": {n: round_key(k, r) for n, k in decl.outputs.items()},
                            "upstream": list(inputs),
                            "params": params,
                        }
                    ),
                    inputs,
                )
            )
    return expanded


def load_pipeline(path: Path, stages: dict[str, type[Stage]], prompts_dir: Path) -> PipelineSpec:
    """Parse, validate and resolve a pipeline file against the known stage kinds."""
    parsed = _parse(path)
    produced: dict[str, str] = {}  # asset key -> the declared asset that produces it
    declared: list[DeclaredAsset] = []
    for decl, input_names in _expand_rounds(path, parsed):
        stage_cls = _stage_of(path, decl, stages)
        _claim_outputs(path, decl, produced)
        _check_outputs(path, decl, stage_cls)
        params = _params(path, decl, stage_cls, parsed)
        prompts = _prompts(path, decl, stage_cls, prompts_dir)
        model = _model(path, decl, params, parsed)
        declared.append(DeclaredAsset(decl, stage_cls, params, prompts, model, input_names))
    _check_upstream(path, declared, produced)
    _check_acyclic(path, declared, produced)
    _check_paired(path, declared, produced)
    return PipelineSpec(path, declared)


def _parse(path: Path) -> PipelineFile:
    """The file read and validated against the schema; an error names the asset (by key, or
    by position when it has none) and the field."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineSpecError(f"{path}: pipeline file not found") from None
    except yaml.YAMLError as err:
        raise PipelineSpecError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise _fail(path, None, None, "expected a mapping with an 'assets' list")
    try:
        return PipelineFile.model_validate(raw)
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


def _stage_of(path: Path, decl: AssetDecl, stages: dict[str, type[Stage]]) -> type[Stage]:
    stage_cls = stages.get(decl.stage)
    if stage_cls is None:
        raise _fail(
            path,
            decl.key,
            "stage",
            f"unknown stage kind {decl.stage!r}; known: {', '.join(sorted(stages))}",
        )
    return stage_cls


def _claim_outputs(path: Path, decl: AssetDecl, produced: dict[str, str]) -> None:
    """Record the asset keys `decl` produces in `produced`; each key has one producer."""
    for out_key in [decl.key, *decl.outputs.values()]:
        if out_key in produced:
            raise _fail(
                path,
                decl.key,
                "key" if out_key == decl.key else "outputs",
                f"asset key {out_key!r} is already produced by {produced[out_key]!r}",
            )
        produced[out_key] = decl.key


def _check_outputs(path: Path, decl: AssetDecl, stage_cls: type[Stage]) -> None:
    """The asset maps exactly the secondary outputs its stage kind writes."""
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


def _params(path: Path, decl: AssetDecl, stage_cls: type[Stage], parsed: PipelineFile) -> BaseModel:
    try:
        return stage_cls.Params.model_validate(_with_split(path, decl, stage_cls, parsed))
    except ValidationError as err:
        first = err.errors()[0]
        raise _fail(path, decl.key, _loc(("params", *first["loc"])), first["msg"]) from None


def _prompts(
    path: Path, decl: AssetDecl, stage_cls: type[Stage], prompts_dir: Path
) -> dict[str, PromptTemplate]:
    """The templates of exactly the prompt roles the stage kind has."""
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
                path, decl.key, f"prompts.{role}", f"template {name!r} not found in {prompts_dir}"
            ) from None
    return prompts


def _model(path: Path, decl: AssetDecl, params: BaseModel, parsed: PipelineFile) -> str | None:
    """The model id of the role the asset's params name (None: the resource's default)."""
    role = getattr(params, "model", None)
    if role is None:
        return None
    if role not in parsed.models:
        raise _fail(
            path,
            decl.key,
            "params.model",
            f"unknown model role {role!r}; the models section declares {sorted(parsed.models)}",
        )
    return parsed.models[role]


def _check_upstream(path: Path, declared: list[DeclaredAsset], produced: dict[str, str]) -> None:
    for asset in declared:
        for up in asset.decl.upstream:
            if up not in produced:
                raise _fail(path, asset.key, "upstream", f"unknown upstream asset {up!r}")
            if up in asset.output_keys():
                raise _fail(path, asset.key, "upstream", "an asset cannot depend on itself")


def _check_paired(path: Path, declared: list[DeclaredAsset], produced: dict[str, str]) -> None:
    """The evaluations a stage pairs problem by problem declare one `max_problems`: the pairs
    cover only the problems every one of them evaluated, so the smallest would decide."""
    by_key = {asset.key: asset for asset in declared}
    for asset in declared:
        if not asset.stage_cls.pairs_upstream:
            continue
        sizes = {
            up: by_key[produced[up]].params.max_problems
            for up in asset.decl.upstream
            if "max_problems" in type(by_key[produced[up]].params).model_fields
        }
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{up} {'null' if n is None else n}" for up, n in sizes.items())
            raise _fail(
                path,
                asset.key,
                "upstream",
                f"the evaluations it pairs problem by problem declare different max_problems "
                f"({listed}): it would compare them on the fewest only; give them one value",
            )


def _with_split(
    path: Path, decl: AssetDecl, stage_cls: type[Stage], parsed: PipelineFile
) -> dict[str, Any]:
    """The asset's params, with the file's held-out split for a stage that reads it. The split
    is declared once: an asset may not set its own."""
    if "heldout" not in stage_cls.Params.model_fields:
        return decl.params
    for own in ("heldout", "heldout_fraction"):
        if own in decl.params:
            raise _fail(
                path,
                decl.key,
                f"params.{own}",
                "the held-out split is declared once, in the top-level `heldout:` section "
                "(fraction, salt), for every stage that trains or evaluates",
            )
    return {**decl.params, "heldout": parsed.heldout.model_dump()}


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
