"""`rstar`: the project's command line (queries, seed batches, the demo and its evaluation, model
export, a sparse vLLM server)."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import click

from rstar_pipelines import settings

DEMO_BATCH = "demo"


def _instance():
    import dagster as dg

    if not os.environ.get("DAGSTER_HOME"):
        raise click.ClickException(
            "DAGSTER_HOME is not set: export DAGSTER_HOME=$PWD/.dagster_home (on local disk, "
            "not NFS) so partitions and run history persist"
        )
    home = Path(os.environ["DAGSTER_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():  # the machine may have no route out: do not try to send any
        config.write_text("telemetry:\n  enabled: false\n")
    return dg.DagsterInstance.get()


def _incoming_dir() -> Path:
    from rstar_pipelines.definitions import load_spec
    from rstar_pipelines.seeds.stages import SeedIngestion

    ingestions = load_spec().with_stage(SeedIngestion)
    if len(ingestions) != 1:
        raise click.ClickException("expected exactly one SeedIngestion asset in pipeline.yaml")
    return ingestions[0].stage().incoming_dir()


def add_seed_batch(source: Path, batch: str | None = None) -> str:
    """Copy a seed file into the incoming directory and register its partition."""
    from rstar_pipelines.partitions import seed_batches
    from rstar_pipelines.seeds.parse import SEED_SUFFIXES

    if source.suffix not in SEED_SUFFIXES:
        raise click.ClickException(f"{source}: seed files must end in {', '.join(SEED_SUFFIXES)}")
    batch = batch or source.stem
    target = _incoming_dir() / f"{batch}{source.suffix}"
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.resolve() != target.resolve():
        shutil.copyfile(source, target)
    instance = _instance()
    if not instance.has_dynamic_partition(seed_batches.name, batch):
        instance.add_dynamic_partitions(seed_batches.name, [batch])
    return batch


@click.group()
def main() -> None:
    """rstar-pipelines: verified reasoning data and checkpoints on Dagster."""


@main.command()
@click.argument("sql")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table")
@click.option("--max-rows", default=50, show_default=True, help="Rows shown in table format.")
def query(sql: str, fmt: str, max_rows: int) -> None:
    """Run SQL over the assets (one DuckDB view per asset, e.g. seed_problems)."""
    import duckdb

    from rstar_pipelines.storage.query import query as run_query

    try:
        table = run_query(sql)
    except duckdb.Error as err:
        raise click.ClickException(
            f"{err}\n(views come from the Parquet files under {settings.lake_dir()})"
        ) from None
    frame = table.to_pandas()
    if fmt == "csv":
        click.echo(frame.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(frame.to_json(orient="records", lines=True), nl=False)
    else:
        click.echo(frame.head(max_rows).to_string(index=False))
        if len(frame) > max_rows:
            click.echo(f"... {len(frame)} rows in all")


def evaluation_report(instance) -> str:
    """The latest materialization of every round's eval_comparison: the methods' table, the
    verdict on significance and the oracle's table apart."""
    import dagster as dg

    from rstar_pipelines.definitions import load_spec
    from rstar_pipelines.dser.comparison import EvaluationComparison

    parts = []
    for asset in load_spec().with_stage(EvaluationComparison):
        event = instance.get_latest_materialization_event(dg.AssetKey(asset.key))
        if event is None:
            continue
        shown = {k: v.value for k, v in event.asset_materialization.metadata.items()}
        parts.append(
            f"{asset.key}: {shown['problems']} held-out problems\n\n{shown['comparison']}\n\n"
            f"{shown['significance']}\n\n{shown['oracle']}"
        )
    if not parts:
        raise click.ClickException(
            f"no eval_comparison is materialized in DAGSTER_HOME={os.environ['DAGSTER_HOME']}: "
            f"run `rstar demo`, or materialize eval_comparison and its upstream assets"
        )
    return "\n\n".join(parts)


@main.command("eval")
def evaluate() -> None:
    """Print the evaluation: every round's eval_comparison, as last materialized."""
    click.echo(evaluation_report(_instance()))


@main.group()
def seeds() -> None:
    """Seed batches."""


@seeds.command("add")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--batch", help="Partition name (default: the file's stem).")
def seeds_add(path: Path, batch: str | None) -> None:
    """Copy a seed file into the incoming directory and register its partition."""
    name = add_seed_batch(path, batch)
    click.echo(
        f"added seed batch {name!r}; materialize it with:\n"
        f"  dg launch --assets seed_problems,seed_rejects --partition {name}"
    )


# Model loading draws tqdm bars (GGUF de-quantization, checkpoint shards): not for people
# watching a pipeline, nor for the UI's logs. Set before transformers is imported; the
# training processes inherit it.
QUIET_PROGRESS_BARS = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


# Not $DAGSTER_HOME/logs: that is Dagster's telemetry directory, whose files `dagster dev`
# moves away to upload them to Dagster's telemetry server (even with telemetry disabled in
# dagster.yaml), so `make dev` after the demo would take the demo's event log away.
EVENT_LOG_DIR = "event_logs"


@main.command()
def demo() -> None:
    """Materialize the whole declared graph for the demo seed batch."""
    for name, value in QUIET_PROGRESS_BARS.items():
        os.environ.setdefault(name, value)
    from rstar_pipelines import progress
    from rstar_pipelines.definitions import defs, load_spec
    from rstar_pipelines.materialize import materialize_graph

    os.environ.setdefault("DAGSTER_HOME", str(Path(".dagster_home").resolve()))
    demo_file = settings.assets_dir() / "seeds" / "demo" / f"{DEMO_BATCH}.jsonl"
    add_seed_batch(demo_file)
    instance = _instance()
    event_log = (
        Path(os.environ["DAGSTER_HOME"])
        / EVENT_LOG_DIR
        / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.log"
    )
    click.echo(f"Dagster's full event log: {event_log}")
    with progress.console():
        results = materialize_graph(defs, load_spec(), DEMO_BATCH, instance, event_log)
    failed = [r for r in results if not r.success]
    click.echo(f"\n{len(results)} runs: {', '.join(r.job_def.name for r in results)}")
    if failed:
        raise click.ClickException(f"a run failed; its events are in {event_log}")
    click.echo(f"\n{evaluation_report(instance)}\n")
    bin_dir = os.path.relpath(Path(sys.executable).parent)
    click.echo(
        f"Event log:   {event_log}\n"
        f"Evaluation:  {bin_dir}/rstar eval (the tables above)\n"
        f"Outputs:     {settings.lake_dir()} (Parquet, one file per asset partition)\n"
        f"Query them:  {bin_dir}/rstar query "
        f'"select domain, count(*) from seed_problems group by 1"\n'
        f"Open the UI: make dev   (or: DAGSTER_HOME={os.environ['DAGSTER_HOME']} "
        f"{bin_dir}/dagster dev); it runs nothing the demo did"
    )


@main.command()
@click.option(
    "--queues",
    required=True,
    help="Comma-separated queues this host serves: pools of pipeline.yaml (llm, sandbox, "
    "gpu) and `dagster` for steps in no pool.",
)
@click.option("--concurrency", default=1, show_default=True, help="Steps run at once.")
@click.option("--name", help="Worker name (shown on each step's events).")
def worker(queues: str, concurrency: int, name: str | None) -> None:
    """A Celery worker of the `hosts` profile (docs/scale-out.md)."""
    from rstar_pipelines.deployment.worker import run_worker

    names = [q.strip() for q in queues.split(",") if q.strip()]
    try:
        run_worker(names, concurrency, name)
    except ValueError as err:
        raise click.ClickException(str(err)) from None


@main.group()
def recipe() -> None:
    """Declared runs of the whole graph (assets/recipes/NAME.yaml): check, estimate, run."""


_OVERRIDE = click.option(
    "--override",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A YAML of the recipe's shape merged over it (e.g. fewer problems).",
)


def _checked_recipe(name: str, override: Path | None):
    from rstar_pipelines import recipes
    from rstar_pipelines.pipeline.spec import PipelineSpecError

    try:
        loaded = recipes.load_recipe(name, override)
        return recipes.validate(loaded, name, settings.data_dir() / "recipes" / name)
    except (recipes.RecipeError, PipelineSpecError) as err:
        raise click.ClickException(str(err)) from None


@recipe.command("validate")
@click.argument("name")
@_OVERRIDE
def recipe_validate(name: str, override: Path | None) -> None:
    """Load the recipe's pipeline and seed files and check its held-out split."""
    checked = _checked_recipe(name, override)
    click.echo(
        f"recipe {name} is valid: {len(checked.spec.assets)} assets, {len(checked.selected)} "
        f"outputs selected; seeds {checked.seeds}; {checked.heldout_seeds} held-out seed groups"
    )


@recipe.command("dry-run")
@click.argument("name")
@_OVERRIDE
def recipe_dry_run(name: str, override: Path | None) -> None:
    """Print each stage's expected tokens and wall time from the recipe's assumptions."""
    from rstar_pipelines.recipes import dry_run_report

    click.echo(dry_run_report(_checked_recipe(name, override), name))


@recipe.command("run")
@click.argument("name")
@_OVERRIDE
def recipe_run(name: str, override: Path | None) -> None:
    """Ingest the recipe's seed files and materialize its assets, batch by batch."""
    from rstar_pipelines import recipes
    from rstar_pipelines.definitions import build_definitions
    from rstar_pipelines.partitions import seed_batches
    from rstar_pipelines.seeds.stages import SeedIngestion

    checked = _checked_recipe(name, override)
    with recipes.llm_environment(checked.recipe):
        if os.environ.get("RSTAR_LLM_BACKEND") == "openai" and not os.environ.get(
            "RSTAR_LLM_BASE_URL"
        ):
            raise click.ClickException(
                f"recipe {name} generates on OpenAI-compatible servers: set RSTAR_LLM_BASE_URL "
                "to their URLs (comma-separated)"
            )
        [ingestion] = checked.spec.with_stage(SeedIngestion)
        written = recipes.write_seed_files(checked.recipe, ingestion.stage().incoming_dir())
        instance = _instance()
        batches = [batch for batch, _ in written]
        instance.add_dynamic_partitions(
            seed_batches.name,
            [b for b in batches if not instance.has_dynamic_partition(seed_batches.name, b)],
        )
        defs = build_definitions(checked.spec)
        results = recipes.materialize_selected(
            defs, checked.spec, checked.selected, batches, instance
        )
    failed = [r for r in results if not r.success]
    click.echo(f"recipe {name}: {len(results)} runs, {len(failed)} failed")
    if failed:
        raise click.ClickException(f"recipe {name}: run {failed[0].run_id} failed")


@main.group()
def deploy() -> None:
    """Deployment profiles (RSTAR_DEPLOYMENT=local|hosts|k8s)."""


def _pool_limit(ctx, param, values: tuple[str, ...]) -> dict[str, int]:
    limits = {}
    for value in values:
        name, sep, limit = value.partition("=")
        if not sep or not limit.isdigit():
            raise click.BadParameter(f"{value!r}: expected POOL=LIMIT, e.g. gpu=2")
        limits[name] = int(limit)
    return limits


@deploy.command("init")
@click.option(
    "--profile",
    type=click.Choice(["hosts", "k8s"]),
    help="Default: RSTAR_DEPLOYMENT.",
)
@click.option("--max-runs", type=int, help="Runs in progress at once (the run queue's limit).")
@click.option(
    "--pool",
    "pools",
    multiple=True,
    callback=_pool_limit,
    help="POOL=LIMIT, repeatable: steps of a pool running at once across all hosts.",
)
def deploy_init(profile: str | None, max_runs: int | None, pools: dict[str, int]) -> None:
    """Write $DAGSTER_HOME/dagster.yaml for the profile, create the instance's tables in
    Postgres and set the pool limits."""
    from rstar_pipelines.definitions import load_spec
    from rstar_pipelines.deployment.instance import init_instance

    profile = profile or settings.deployment()
    if profile == "local":
        raise click.ClickException("the local profile keeps Dagster's defaults: nothing to do")
    if not os.environ.get("DAGSTER_HOME"):
        raise click.ClickException("DAGSTER_HOME is not set")
    if not settings.postgres_url():
        raise click.ClickException(f"{settings.POSTGRES_URL_ENV} is not set")
    try:
        limits = init_instance(
            Path(os.environ["DAGSTER_HOME"]), profile, load_spec().pools(), pools, max_runs
        )
    except ValueError as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"wrote {os.environ['DAGSTER_HOME']}/dagster.yaml ({profile}); pool limits:")
    for pool, limit in limits.items():
        click.echo(f"  {pool}: {limit}")


@deploy.command("render-k8s")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--image", required=True, help="The pipeline's image (RSTAR_IMAGE in the cluster).")
@click.option("--namespace", default="rstar", show_default=True)
def deploy_render_k8s(out: Path, image: str, namespace: str) -> None:
    """Write the Job and Pod specs of the k8s profile (one per pool, the run worker, a
    training pod) as YAML, to review or apply by hand."""
    import yaml

    from rstar_pipelines.definitions import load_spec
    from rstar_pipelines.deployment.k8s import render_jobs

    out.mkdir(parents=True, exist_ok=True)
    for name, body in render_jobs(load_spec().pools(), image, namespace).items():
        path = out / f"{name.replace(':', '-')}.yaml"
        path.write_text(yaml.safe_dump(body, sort_keys=False))
        click.echo(f"wrote {path}")


@main.group()
def model() -> None:
    """The embedded default model."""


@model.command("export")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
def model_export(dest: Path) -> None:
    """Write the embedded SmolLM2 GGUF model as a Hugging Face directory (for
    `transformers serve DEST` or `vllm serve DEST`)."""
    from rstar_pipelines.llm import export_embedded_model

    export_embedded_model(dest)
    click.echo(f"wrote {dest}")


def _gpu_memory_bytes() -> int | None:
    """The first GPU's memory, when torch sees one (vLLM serves on it)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("model")
@click.option("--gates", required=True, help="The SeerGates directory trained for MODEL.")
@click.option("--token-budget", type=int, help="Tokens read per decode step (default 4096).")
@click.option("--threshold", type=float, help="Keep the blocks above this gate probability.")
@click.option("--kernel", default="triton", show_default=True, help="triton or tilelang")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--served-model-name", help="Default: MODEL and the sparse settings.")
@click.option("--dry-run", is_flag=True, help="Print the command and environment; start nothing.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(
    model: str,
    gates: str,
    token_budget: int | None,
    threshold: float | None,
    kernel: str,
    host: str,
    port: int,
    served_model_name: str | None,
    dry_run: bool,
    vllm_args: tuple[str, ...],
) -> None:
    """Start `vllm serve MODEL` with SeerAttention-R sparse decoding (the rstar_seer plugin,
    the CUSTOM attention backend, the gates' block size as page size) and print the RSTAR_LLM_*
    settings that point the pipeline at it. Arguments after `--` go to vllm serve."""
    from rstar_pipelines.llm.serve import serve_plan

    try:
        plan = serve_plan(
            model, gates, token_budget=token_budget, threshold=threshold, kernel=kernel,
            host=host, port=port, served_model_name=served_model_name, vllm_args=vllm_args,
            gpu_memory_bytes=_gpu_memory_bytes(),
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        raise click.ClickException(str(err)) from None
    for warning in plan.warnings:
        click.echo(f"warning: {warning}", err=True)
    for note in plan.notes:
        click.echo(f"# {note}")
    env_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    click.echo(f"# the server:\n{env_line} {shlex.join(plan.command)}")
    click.echo("# the pipeline:")
    for name, value in plan.settings.items():
        click.echo(f"export {name}={shlex.quote(value)}")
    if dry_run:
        return
    executable = shutil.which(plan.command[0])
    if executable is None:
        raise click.ClickException(
            "vllm is not installed here: pip install 'rstar-pipelines[gpu]' (vLLM 0.32.0)"
        )
    sys.stdout.flush()
    os.execve(executable, plan.command, {**os.environ, **plan.env})


@main.group()
def sandbox() -> None:
    """The code sandbox (rstar_sandbox)."""


@sandbox.command("build-image")
@click.option("--image", help="Tag to build (default: rstar-sandbox:<version of its recipe>).")
def sandbox_build_image(image: str | None) -> None:
    """Build the sandbox image offline (debootstrap + docker import); no-op if it exists."""
    from rstar_sandbox.image import build_image

    tag, built = build_image(image=image)
    click.echo(f"{'built' if built else 'already present:'} {tag}")


@sandbox.command("run")
@click.argument("program", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--stdin", "stdin_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--backend", default="auto", type=click.Choice(["auto", "docker", "process"]))
@click.option("--timeout", "timeout_s", default=10.0, show_default=True)
@click.option("--memory-mb", default=256, show_default=True)
def sandbox_run(
    program: Path, stdin_file: Path | None, backend: str, timeout_s: float, memory_mb: int
) -> None:
    """Run one Python program in the sandbox and show what happened."""
    from rstar_sandbox import Job, Sandbox

    job = Job(
        code=program.read_text(),
        stdin=stdin_file.read_text() if stdin_file else "",
        timeout_s=timeout_s,
        memory_mb=memory_mb,
    )
    with Sandbox(backend=backend, workers=1) as sb:
        [result] = sb.run([job])
    click.echo(result.stdout, nl=False)
    click.echo(result.stderr, nl=False, err=True)
    click.echo(
        f"[{result.status}] exit {result.exit_code}, {result.wall_s * 1e3:.1f} ms wall, "
        f"{result.cpu_s * 1e3:.1f} ms CPU, {result.peak_memory_mb:.1f} MB peak",
        err=True,
    )
    sys.exit(0 if result.ok else 1)


@sandbox.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8790, show_default=True)
@click.option("--backend", default="auto", type=click.Choice(["auto", "docker", "process"]))
@click.option("--workers", type=int, help="Pool size (default: the number of CPUs).")
@click.option(
    "--max-queue", type=int, help="Jobs admitted at once; more get 429 (default: 256 per worker)."
)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="File holding the bearer token clients must send (default: RSTAR_SANDBOX_TOKEN).",
)
def sandbox_serve(
    host: str,
    port: int,
    backend: str,
    workers: int | None,
    max_queue: int | None,
    token_file: Path | None,
) -> None:
    """Serve the sandbox pool over HTTP (a batch endpoint, /health, /metrics). Bound
    beyond loopback it requires a token."""
    from rstar_sandbox import Sandbox
    from rstar_sandbox.http_client import TOKEN_ENV
    from rstar_sandbox.service import SandboxService, is_loopback, serve

    token = token_file.read_text().strip() if token_file else os.environ.get(TOKEN_ENV)
    if not is_loopback(host) and not token:
        raise click.ClickException(
            f"refusing to serve on {host} without a token: set {TOKEN_ENV} or --token-file"
        )
    with Sandbox(backend=backend, workers=workers) as sb:
        serve(SandboxService(sb, max_queue=max_queue, token=token or None), host, port)


@sandbox.command("bench")
@click.option("--backend", default="auto", type=click.Choice(["auto", "docker", "process"]))
@click.option("--workers", type=int, help="Pool size (default: the number of CPUs).")
@click.option("--jobs", default=500, show_default=True, help="Trivial jobs per client count.")
def sandbox_bench(backend: str, workers: int | None, jobs: int) -> None:
    """Quick throughput check of the pool (the full benchmark: benchmarks/sandbox_throughput.py)."""
    from rstar_sandbox import Sandbox
    from rstar_sandbox.bench import HEADER, TRIVIAL, bench_pool

    with Sandbox(backend=backend, workers=workers) as sb:
        click.echo(HEADER)
        for row in bench_pool(sb, {"trivial": (TRIVIAL, jobs)}, [1, 8]):
            click.echo(row.row())


if __name__ == "__main__":
    sys.exit(main())
