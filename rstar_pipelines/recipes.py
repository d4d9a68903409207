"""Recipes: declared runs of the whole graph (assets/recipes/<name>.yaml), checked, estimated and
run with one command each (`rstar recipe validate|dry-run|run NAME`).

A recipe is pipeline.yaml with its own overrides (models, rounds, the held-out split, any asset's
parameters), the seed files it ingests, the LLM backend it generates with, and the assumptions its
dry run turns into a wall time and a token count per stage: servers and their throughput, and per
stage the completions per problem and their tokens. The figures a dry run prints are those
assumptions multiplied out, never measurements.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import dagster as dg
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rstar_pipelines import settings
from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.materialize import run_waves
from rstar_pipelines.pipeline.spec import PipelineSpec, load_pipeline
from rstar_pipelines.problems import near_duplicate_groups
from rstar_pipelines.seeds.parse import parse_seed_file
from rstar_pipelines.stages import STAGES

BATCH_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file and what is wrong."""


class SeedFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: str = Field(pattern=BATCH_NAME, description="the seed batch (partition) it becomes")
    path: str = Field(description="a seed file; relative paths are under the repository root")
    limit: int | None = Field(None, ge=1, description="ingest only its first N problems")

    def resolved(self) -> Path:
        path = Path(self.path)
        return path if path.is_absolute() else settings.REPO_ROOT / path


class Throughput(BaseModel):
    """The fleet the dry run assumes: tokens per second of one server, all requests together."""

    model_config = ConfigDict(extra="forbid")

    servers: int = Field(ge=1)
    prefill_tokens_per_s: float = Field(gt=0)
    decode_tokens_per_s: float = Field(gt=0)
    gpus_for_training: int = Field(1, ge=1, description="GPUs one training job runs on")


class StageEstimate(BaseModel):
    """What one asset costs per problem (per round, for a per-round asset): generation on the
    fleet (completions and their mean tokens) or training (GPU hours per job)."""

    model_config = ConfigDict(extra="forbid")

    over: Literal["seeds", "problems", "training", "heldout"] = Field(
        description="the problems it works on: the seeds, all verified problems, or one side"
    )
    completions: float = Field(0, ge=0, description="completions per problem")
    prompt_tokens: float = Field(0, ge=0, description="mean prompt tokens of a completion")
    completion_tokens: float = Field(0, ge=0, description="mean generated tokens of a completion")
    gpu_hours: float = Field(0, ge=0, description="a training job's GPU hours")
    max_problems: int | None = Field(None, ge=1, description="problems it takes at most")


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str
    pipeline: dict[str, Any] = Field(
        default_factory=dict,
        description="overrides of pipeline.yaml: models, rounds, heldout, and assets (asset "
        "key -> params merged into the declared ones)",
    )
    llm: dict[str, str] = Field(
        default_factory=dict,
        description="RSTAR_LLM_* settings of the run (backend, model, ...); the fleet's URLs "
        "come from RSTAR_LLM_BASE_URL",
    )
    seeds: list[SeedFile] = Field(min_length=1)
    select: list[str] | None = Field(None, description="the assets to materialize (all: null)")
    min_heldout: int = Field(0, ge=0, description="the least held-out seeds the run must have")
    verified_per_seed: float = Field(
        1.0, gt=0, description="assumed verified problems per seed (the seed and its syntheses)"
    )
    throughput: Throughput
    estimates: dict[str, StageEstimate] = {}


def recipes_dir() -> Path:
    return settings.assets_dir() / "recipes"


def load_recipe(name: str, override: Path | None = None) -> Recipe:
    """assets/recipes/<name>.yaml, with `override` (a YAML of the same shape) merged over it."""
    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
        raise RecipeError(f"no recipe {name!r} in {recipes_dir()} (there are: {known})")
    data = _yaml(path)
    if override is not None:
        data = merged(data, _yaml(override))
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        where = f"{path}" + (f" with {override}" if override else "")
        raise RecipeError(f"{where}: {error}") from None


def _yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping")
    return data


def merged(base: Any, over: Any) -> Any:
    """`over` merged into `base`: mappings key by key, anything else replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merged(base.get(k), v) for k, v in over.items()}}
    return copy.deepcopy(over)


def pipeline_text(recipe: Recipe, name: str) -> str:
    """pipeline.yaml with the recipe's overrides, as YAML."""
    declared = yaml.safe_load(settings.pipeline_file().read_text())
    overrides = dict(recipe.pipeline)
    params = overrides.pop("assets", {}) or {}
    unknown = set(overrides) - {"models", "rounds", "heldout"}
    if unknown:
        raise RecipeError(f"recipe {name}: pipeline: unknown keys {sorted(unknown)}")
    declared = merged(declared, overrides)
    keys = {a["key"] for a in declared["assets"]}
    missing = sorted(set(params) - keys)
    if missing:
        raise RecipeError(f"recipe {name}: pipeline.assets: no declared asset {missing}")
    for asset in declared["assets"]:
        if asset["key"] in params:
            asset["params"] = merged(asset.get("params", {}), params[asset["key"]])
    return yaml.safe_dump(declared, sort_keys=False)


@dataclass(frozen=True)
class Checked:
    """A recipe that validated: its pipeline, seeds per batch and held-out seeds."""

    recipe: Recipe
    spec: PipelineSpec
    seeds: dict[str, int]
    heldout_seeds: int
    selected: list[str]


def validate(recipe: Recipe, name: str, workdir: Path) -> Checked:
    """Loads the recipe's pipeline (every error names the asset and field), reads its seed files
    and counts the held-out seeds (by their near-duplicate groups), and checks the selection and
    the estimates name declared assets. Writes the pipeline to `workdir`/pipeline.yaml."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "pipeline.yaml"
    path.write_text(pipeline_text(recipe, name))
    spec = load_pipeline(path, STAGES, settings.prompts_dir())
    keys = {k for a in spec.assets for k in a.output_keys()}
    for field, named in (("select", recipe.select or []), ("estimates", recipe.estimates)):
        unknown = sorted(set(named) - keys)
        if unknown:
            raise RecipeError(f"recipe {name}: {field}: no declared asset {unknown}")
    rows, counts = [], {}
    for seed in recipe.seeds:
        problems = _seed_rows(seed, name)
        counts[seed.batch] = len(problems)
        rows += [{**p, "is_seed": True, "seed_id": p["id"]} for p in problems]
    split = HeldoutSplit.model_validate(yaml.safe_load(path.read_text()).get("heldout", {}))
    groups = {g.group for g in near_duplicate_groups(rows, split.similarity).values()}
    heldout = sum(split.is_heldout(g) for g in groups)
    if heldout < recipe.min_heldout:
        raise RecipeError(
            f"recipe {name}: {heldout} held-out seed groups of {len(groups)}, fewer than "
            f"min_heldout {recipe.min_heldout}: raise heldout.fraction or add seeds"
        )
    selected = recipe.select or [k for a in spec.assets for k in a.output_keys()]
    return Checked(recipe, spec, counts, heldout, selected)


def _seed_rows(seed: SeedFile, name: str) -> list[dict[str, Any]]:
    path = seed.resolved()
    if not path.is_file():
        raise RecipeError(f"recipe {name}: seeds: batch {seed.batch}: {path} is not a file")
    parsed = parse_seed_file(path, seed.batch)
    if parsed.rejects:
        first = parsed.rejects[0]
        raise RecipeError(
            f"recipe {name}: seeds: {path}: {len(parsed.rejects)} rows rejected, the first at "
            f"line {first['line']}: {first['reason']}"
        )
    return parsed.problems[: seed.limit]


# -- the dry run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCost:
    asset: str
    jobs: int  # rounds it runs in
    problems: int  # per job
    completions: float
    prompt_tokens: float
    completion_tokens: float
    hours: float


def estimate(checked: Checked) -> list[StageCost]:
    """Each estimated asset's problems, completions, tokens and wall hours, from the recipe's
    assumptions: a stage's tokens spread evenly over the fleet (prefill and decode at their
    declared rates), a training job on its GPUs for its declared hours."""
    recipe, spec = checked.recipe, checked.spec
    seeds = sum(checked.seeds.values())
    heldout_share = checked.heldout_seeds / max(1, seeds)
    problems = seeds * recipe.verified_per_seed
    sizes = {
        "seeds": seeds,
        "problems": problems,
        "heldout": problems * heldout_share,
        "training": problems * (1 - heldout_share),
    }
    fleet = recipe.throughput
    costs = []
    for key, est in recipe.estimates.items():
        jobs = sum(1 for a in spec.assets if a.key == key or a.key.startswith(f"{key}_r"))
        count = int(min(sizes[est.over], est.max_problems or sizes[est.over]))
        completions = count * est.completions * jobs
        prompt, generated = completions * est.prompt_tokens, completions * est.completion_tokens
        seconds = (
            prompt / fleet.prefill_tokens_per_s + generated / fleet.decode_tokens_per_s
        ) / fleet.servers
        hours = seconds / 3600 + est.gpu_hours * jobs / fleet.gpus_for_training
        costs.append(StageCost(key, jobs, count, completions, prompt, generated, hours))
    return costs


def dry_run_report(checked: Checked, name: str) -> str:
    costs = estimate(checked)
    fleet = checked.recipe.throughput
    lines = [
        f"recipe {name}: {checked.recipe.description.strip()}",
        f"seeds: {checked.seeds} ({checked.heldout_seeds} held-out seed groups); "
        f"{checked.recipe.verified_per_seed} verified problems per seed assumed",
        f"fleet assumed: {fleet.servers} servers, each {fleet.prefill_tokens_per_s:,.0f} prompt "
        f"and {fleet.decode_tokens_per_s:,.0f} generated tokens/s; a training job on "
        f"{fleet.gpus_for_training} device(s)",
        "",
        f"{'asset':<28}{'jobs':>5}{'problems':>10}{'completions':>14}{'prompt tok':>14}"
        f"{'generated tok':>15}{'hours':>9}",
    ]
    for c in costs:
        lines.append(
            f"{c.asset:<28}{c.jobs:>5}{c.problems:>10}{c.completions:>14,.0f}"
            f"{c.prompt_tokens:>14,.0f}{c.completion_tokens:>15,.0f}{c.hours:>9.2f}"
        )
    lines.append(
        f"{'total':<28}{'':>5}{'':>10}{sum(c.completions for c in costs):>14,.0f}"
        f"{sum(c.prompt_tokens for c in costs):>14,.0f}"
        f"{sum(c.completion_tokens for c in costs):>15,.0f}{sum(c.hours for c in costs):>9.2f}"
    )
    lines.append(
        "Assumptions multiplied out (the recipe's throughput and estimates), not measurements; "
        "stages run one after another."
    )
    return "\n".join(lines)


# -- the run --------------------------------------------------------------------------------


def write_seed_files(recipe: Recipe, incoming: Path) -> list[tuple[str, Path]]:
    """Each seed file into the incoming directory as its batch (its first `limit` rows only,
    when limited); (batch, file) pairs."""
    incoming.mkdir(parents=True, exist_ok=True)
    written = []
    for seed in recipe.seeds:
        source = seed.resolved()
        target = incoming / f"{seed.batch}{source.suffix if seed.limit is None else '.jsonl'}"
        if seed.limit is None:
            target.write_bytes(source.read_bytes())
        else:
            rows = parse_seed_file(source, seed.batch).problems[: seed.limit]
            keep = ("domain", "problem", "answer", "oracle_solutions", "examples", "time_limit_s")
            target.write_text(
                "".join(
                    json.dumps({k: r[k] for k in keep if r.get(k) not in (None, [])}) + "\n"
                    for r in rows
                )
            )
        written.append((seed.batch, target))
    return written


@contextmanager
def llm_environment(recipe: Recipe) -> Iterator[None]:
    """The recipe's RSTAR_LLM_* settings for the run (those already set in the environment win:
    the fleet's URLs, an API key)."""
    names = {f"RSTAR_LLM_{k.upper()}": v for k, v in recipe.llm.items()}
    added = [n for n in names if n not in os.environ]
    os.environ.update({n: names[n] for n in added})
    try:
        yield
    finally:
        for n in added:
            os.environ.pop(n, None)


def materialize_selected(
    defs: dg.Definitions,
    spec: PipelineSpec,
    selected: Sequence[str],
    batches: Sequence[str],
    instance: dg.DagsterInstance,
) -> list[dg.ExecuteInProcessResult]:
    """The selected assets, wave by wave of the declared graph, the partitioned ones once per
    batch; stops at the first failed run."""
    results = []
    for wave in run_waves(spec):
        keys = [k for asset in wave for k in asset.output_keys() if k in selected]
        if not keys:
            continue
        for batch in batches if wave.partitioned else [None]:
            result = dg.materialize(
                list(defs.assets),
                selection=keys,
                partition_key=batch,
                instance=instance,
                resources=dict(defs.resources),
                raise_on_error=False,
            )
            results.append(result)
            if not result.success:
                return results
    return results
