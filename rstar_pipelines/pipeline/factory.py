"""Dagster assets built from the declared pipeline.

One multi-asset per declared entry (its own key plus any secondary outputs). The
compute function only adapts: it hands plain Arrow tables to the stage, checks the
tables it returns against the stage's declared schema, and reports what a user
needs in the UI (row counts, column schema, a preview, the stage's own figures).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from functools import reduce
from typing import Any

import dagster as dg
import pyarrow as pa

from rstar_pipelines import progress
from rstar_pipelines.deployment import run_out_of_process, step_tags
from rstar_pipelines.partitions import PARTITIONINGS
from rstar_pipelines.pipeline.cache_store import cache_location
from rstar_pipelines.pipeline.spec import DeclaredAsset, PipelineSpec
from rstar_pipelines.pipeline.stage import Markdown, StageContext, StageInputError, StageResult
from rstar_pipelines.storage import schemas

PREVIEW_ROWS = 5
PREVIEW_CHARS = 80
SIGNIFICANT = 4  # digits of the floats shown in the UI


def _automated(asset: DeclaredAsset) -> bool:
    return (asset.decl.automation or ("eager" if asset.decl.upstream else "none")) != "none"


def _pending(upstream: DeclaredAsset, asset: DeclaredAsset) -> dg.AutomationCondition:
    """True where `upstream`, an ancestor of `asset`, is still to bring itself up to date:
    it is running, or (when it is partitioned differently, so it cannot share a run with
    `asset`) one of its parents updated since the last tick and it did not, so it is
    about to be requested on its own. (Dagster's will_be_requested does not see requests
    that go into another run.) An ancestor that waits for its own upstream waits for one
    of these, an ancestor of `asset` too: checking every ancestor covers it."""
    A = dg.AutomationCondition
    pending = A.in_progress()
    if _automated(upstream) and upstream.partitioned != asset.partitioned:
        pending = pending | (A.any_deps_match(A.newly_updated()) & ~A.newly_updated())
    return pending


def _ancestors(asset: DeclaredAsset, spec: PipelineSpec) -> list[DeclaredAsset]:
    found: dict[str, DeclaredAsset] = {}
    todo = list(asset.decl.upstream)
    while todo:
        producer = spec.producer_of(todo.pop())
        if producer.key not in found:
            found[producer.key] = producer
            todo += producer.decl.upstream
    return list(found.values())


def upstream_still_updating(asset: DeclaredAsset, spec: PipelineSpec) -> dg.AutomationCondition:
    """True while any ancestor of `asset` is still to update (see _pending). Without it an
    asset fed by an early and a late stage of one change (dser_eval reads verified_outputs
    and, four stages later, policy_checkpoint) runs as soon as the early one updates, and
    again when the late one does.

    Every ancestor is visited once, along a breadth-first tree of the lineage: each
    level is `any_deps_match(...)` allowed to one dependency only, so the condition grows
    with the number of ancestors, not with the number of paths to them."""
    children: dict[str, list[str]] = {}
    seen = {asset.key}
    frontier = [asset.key]
    while frontier:
        following = []
        for key in frontier:
            children[key] = []
            for up in spec.producer_of(key).decl.upstream:
                if up not in seen:
                    seen.add(up)
                    children[key].append(up)
                    following.append(up)
        frontier = following

    def below(key: str) -> list[dg.AutomationCondition]:
        return [
            dg.AutomationCondition.any_deps_match(
                reduce(operator.or_, [_pending(spec.producer_of(up), asset), *below(up)])
            )
            .allow(dg.AssetSelection.assets(up))
            .with_label(f"{up} still to update")
            for up in children[key]
        ]

    return reduce(operator.or_, below(asset.key)).with_label("an upstream asset is still to update")


def automation_condition(asset: DeclaredAsset, spec: PipelineSpec) -> dg.AutomationCondition | None:
    if not _automated(asset):
        return None
    if asset.partitioned and all(a.partitioned for a in _ancestors(asset, spec)):
        # What eager requests for a batch on one tick goes into one run, in dependency
        # order, and a running parent blocks its children (any_deps_in_progress).
        return dg.AutomationCondition.eager()
    waits = ~upstream_still_updating(asset, spec)
    if asset.partitioned:  # a later round's search reads the previous round's checkpoints
        return (dg.AutomationCondition.eager() & waits).with_label("eager, upstream first")
    # An aggregate over dynamic partitions must not wait for every batch to exist:
    # one new, unprocessed batch would otherwise block it forever. An unpartitioned
    # upstream asset that was never materialized (a checkpoint) still blocks it.
    condition = (
        dg.AutomationCondition.eager().without(~dg.AutomationCondition.any_deps_missing()) & waits
    )
    whole = [u for u in asset.decl.upstream if not spec.producer_of(u).partitioned]
    if whole:
        missing = dg.AutomationCondition.any_deps_missing().allow(dg.AssetSelection.assets(*whole))
        condition = condition & ~missing
    return condition.with_label("eager (any batch), upstream first")


def _column_schema(schema: pa.Schema) -> dg.TableSchema:
    """The table's columns with their types and the descriptions of the data contracts."""
    return dg.TableSchema(
        columns=[
            dg.TableColumn(f.name, str(f.type), description=schemas.description(f)) for f in schema
        ]
    )


def rounded(value: Any) -> Any:
    """Floats (also inside dicts and lists) to SIGNIFICANT significant digits, never
    cutting the integer part: what the UI shows is read by people."""
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        digits = SIGNIFICANT - 1 - math.floor(math.log10(abs(value)))
        return round(value, max(0, digits))
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


def _preview(table: pa.Table) -> str:
    def cell(value: Any) -> str:
        text = str(value).replace("\n", "\\n").replace("|", "\\|")
        return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"

    head = table.slice(0, PREVIEW_ROWS).to_pylist()
    lines = ["| " + " | ".join(table.column_names) + " |", "|" + "---|" * table.num_columns]
    lines += ["| " + " | ".join(cell(row[c]) for c in table.column_names) + " |" for row in head]
    return "\n".join(lines)


def table_metadata(table: pa.Table) -> dict[str, Any]:
    return {
        "dagster/row_count": table.num_rows,
        "dagster/column_schema": _column_schema(table.schema),
        "preview": dg.MetadataValue.md(_preview(table)),
    }


def _metadata_values(metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        k: dg.MetadataValue.md(v) if isinstance(v, Markdown) else rounded(v)
        for k, v in metadata.items()
    }


def _headline(metadata: dict[str, Any]) -> dict[str, float]:
    """The figures the console's end line shows: yields and rates."""
    return {
        k: v
        for k, v in metadata.items()
        if isinstance(v, float) and ("yield" in k or k.endswith("rate"))
    }


def _check_schema(key: str, table: pa.Table, expected: pa.Schema) -> pa.Table:
    if not isinstance(table, pa.Table):
        raise TypeError(
            f"stage for {key!r} returned {type(table).__name__}, expected a pyarrow.Table"
        )
    if not table.schema.equals(expected, check_metadata=False):
        raise TypeError(
            f"stage for {key!r} broke its data contract:\n"
            f"expected schema\n{expected}\ngot\n{table.schema}"
        )
    return table


def _combine(value: Any, schema: pa.Schema) -> pa.Table:
    """An unpartitioned asset reading a partitioned one gets {partition: table}: one table."""
    if isinstance(value, pa.Table):
        return value
    if value is None:  # no upstream partition materialized yet
        return schema.empty_table()
    tables = [t for _, t in sorted(value.items()) if t is not None]
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables, promote_options="permissive")


def _outs(asset: DeclaredAsset, spec: PipelineSpec) -> dict[str, dg.AssetOut]:
    """The asset's own output and its secondary ones, with what the UI shows of them."""
    decl, stage_cls = asset.decl, asset.stage_cls
    common = {
        "group_name": decl.group,
        "code_version": asset.code_version,
        "kinds": set(stage_cls.kinds),
        "automation_condition": automation_condition(asset, spec),
        "is_required": False,  # needed for subsetting; the stage still yields every selected one
        "metadata": {
            "stage": decl.stage,
            "params": dg.MetadataValue.json(asset.params.model_dump(mode="json")),
            "prompts": dg.MetadataValue.json({r: t.name for r, t in asset.prompts.items()}),
        },
    }
    description = _description(asset)
    outs = {decl.key: dg.AssetOut(description=description, **common)}
    for name, key in decl.outputs.items():
        outs[key] = dg.AssetOut(description=f"The {name} of {decl.key}. {description}", **common)
    return outs


def _description(asset: DeclaredAsset) -> str:
    return asset.decl.description or (asset.stage_cls.__doc__ or "").strip()


def _ins(asset: DeclaredAsset, spec: PipelineSpec) -> dict[str, dg.AssetIn]:
    """One input per upstream asset; an unpartitioned asset reads whichever partitions of a
    partitioned one exist."""
    ins = {}
    for up in asset.decl.upstream:
        fan_in = spec.producer_of(up).partitioned and not asset.partitioned
        ins[up] = dg.AssetIn(
            key=up, metadata={"allow_missing_partitions": True} if fan_in else None
        )
    return ins


def _check_specs(asset: DeclaredAsset) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(
            c.name,
            asset=asset.key,
            description=c.description + (" (a warning: never fails the run)" if c.warn else ""),
            blocking=c.blocking,
        )
        for c in asset.stage_cls.checks
    ]


def build_asset(asset: DeclaredAsset, spec: PipelineSpec) -> dg.AssetsDefinition:
    """The Dagster multi-asset of one declared entry: its wiring here, the stage run in
    `_run_stage`."""
    decl = asset.decl
    upstream_schemas = {up: spec.schema_of(up) for up in decl.upstream}

    @dg.multi_asset(
        name=decl.key,
        outs=_outs(asset, spec),
        ins=_ins(asset, spec),
        partitions_def=PARTITIONINGS[decl.partitioning],
        pool=decl.pool,
        op_tags=step_tags(decl.pool),
        required_resource_keys=set(asset.stage_cls.resources),
        description=_description(asset),
        # Selecting one output of a stage (e.g. only seed_problems) writes just that one.
        can_subset=True,
        check_specs=_check_specs(asset),
    )
    def compute(context, **inputs: Any):  # no annotation: Dagster checks it at runtime
        tables = {asset.input_names[k]: _combine(v, upstream_schemas[k]) for k, v in inputs.items()}
        partition = context.partition_key if context.has_partition_key else None
        with progress.step(decl.key, partition, context.log) as step:
            yield from _run_stage(context, asset, tables, partition, step)

    return compute


def _stage_context(
    context: dg.AssetExecutionContext, asset: DeclaredAsset, partition: str | None
) -> StageContext:
    stage_cls = asset.stage_cls
    return StageContext(
        partition_key=partition,
        log=context.log,
        resources={r: getattr(context.resources, r) for r in stage_cls.resources},
        run_id=context.run.run_id,
        cache_path=cache_location(asset.key, partition),
        cache_namespace=stage_cls.cache_namespace(),
        launcher=lambda command: run_out_of_process(context, command),
    )


def _run_stage(
    context: dg.AssetExecutionContext,
    asset: DeclaredAsset,
    tables: dict[str, pa.Table],
    partition: str | None,
    step: progress.Step,
) -> Iterator[dg.Output | dg.AssetCheckResult]:
    """Run the stage on its input tables, check what it produced against its data contract,
    and yield the selected outputs and check results."""
    decl = asset.decl
    ctx = _stage_context(context, asset, partition)
    try:
        result = asset.stage().run(ctx, tables)
    except StageInputError as err:
        raise dg.Failure(description=f"{decl.key}: {err}", allow_retries=False) from err
    finally:
        ctx.close()
    result.metadata.update(ctx.cache_metadata())
    result.metadata.update(ctx.serving_metadata())
    produced = _produced(asset, result)
    selected = {k: t for k, t in produced.items() if dg.AssetKey(k) in context.selected_asset_keys}
    progress.finished(
        step, {k: t.num_rows for k, t in selected.items()}, _headline(rounded(result.metadata))
    )
    for key, table in selected.items():
        extra = _metadata_values(result.metadata) if key == decl.key else {}
        yield dg.Output(table, output_name=key, metadata={**table_metadata(table), **extra})
    yield from _check_results(context, asset, result)


def _produced(asset: DeclaredAsset, result: StageResult) -> dict[str, pa.Table]:
    """Every table the stage returned, by asset key, each checked against its schema."""
    decl, stage_cls = asset.decl, asset.stage_cls
    produced = {decl.key: _check_schema(decl.key, result.table, stage_cls.schema)}
    for name, key in decl.outputs.items():
        expected = stage_cls.secondary_outputs[name]
        produced[key] = _check_schema(key, result.secondary.get(name), expected)
    return produced


def _check_results(
    context: dg.AssetExecutionContext, asset: DeclaredAsset, result: StageResult
) -> Iterator[dg.AssetCheckResult]:
    """The outcome of each selected check the stage declares; a missing one is a bug."""
    outcomes = {o.name: o for o in result.checks}
    for check in asset.stage_cls.checks:
        check_key = dg.AssetCheckKey(dg.AssetKey(asset.key), check.name)
        if check_key not in context.selected_asset_check_keys:
            continue
        if check.name not in outcomes:
            raise RuntimeError(f"stage {asset.decl.stage} did not report its check {check.name!r}")
        outcome = outcomes[check.name]
        yield dg.AssetCheckResult(
            asset_key=asset.key,
            check_name=check.name,
            passed=outcome.passed,
            severity=dg.AssetCheckSeverity.WARN if check.warn else dg.AssetCheckSeverity.ERROR,
            metadata=_metadata_values(outcome.metadata),
        )


def build_assets(spec: PipelineSpec) -> list[dg.AssetsDefinition]:
    return [build_asset(asset, spec) for asset in spec.assets]
