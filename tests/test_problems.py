"""The held-out split and the check that keeps it out of every training table: by hand, and
through Dagster, where a hand-made leak fails the blocking check and stops the training after
it."""

from __future__ import annotations

import dagster as dg
import pyarrow as pa
import pytest

from rstar_pipelines import settings
from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.math import search_stages
from rstar_pipelines.math.mcts import MCTSConfig, Problem, StepPrompt, search
from rstar_pipelines.problems import no_heldout_check
from rstar_pipelines.storage import query, schemas
from rstar_pipelines.storage.parquet_io import write_table
from rstar_sandbox import Sandbox
from tests.math.test_mcts import ScriptedPolicy

SPLIT = HeldoutSplit(fraction=0.2, salt="rstar-heldout-1")
IDS = [f"p{i}" for i in range(60)]
TRAIN = [i for i in IDS if not SPLIT.is_heldout(i)]
HELDOUT = [i for i in IDS if SPLIT.is_heldout(i)]


def test_the_split_is_fixed_by_salt_and_fraction():
    ids = [f"q{i}" for i in range(4000)]
    held = [i for i in ids if SPLIT.is_heldout(i)]
    assert abs(len(held) / len(ids) - 0.2) < 0.02
    assert held == [
        i for i in ids if HeldoutSplit(fraction=0.2, salt="rstar-heldout-1").is_heldout(i)
    ]
    other = {i for i in ids if HeldoutSplit(fraction=0.2, salt="another").is_heldout(i)}
    assert other != set(held) and abs(len(other) / len(ids) - 0.2) < 0.02
    assert not any(HeldoutSplit(fraction=0.0).is_heldout(i) for i in ids)
    with pytest.raises(ValueError):
        HeldoutSplit(fraction=1.0)


def test_the_check_finds_every_kind_of_leak():
    child = "synthesized-from-a-held-out-seed"
    lineage = {**{i: i for i in IDS}, child: HELDOUT[0]}
    clean = [{"problem_id": TRAIN[0], "seed_id": TRAIN[0]}, {"problem_id": None, "seed_id": None}]
    outcome = no_heldout_check(clean, lineage, SPLIT)
    assert outcome.passed and outcome.metadata["rows_without_a_problem"] == 1
    leaks = [
        {"problem_id": HELDOUT[1], "seed_id": HELDOUT[1]},  # a held-out problem
        {"problem_id": child, "seed_id": None},  # held out by its seed (by id)
        {"problem_id": TRAIN[1], "seed_id": HELDOUT[2]},  # a seed that is held out, and wrong
        {"problem_id": "never-synthesized", "seed_id": TRAIN[3]},  # lineage unknown
    ]
    outcome = no_heldout_check(clean + leaks, lineage, SPLIT)
    assert not outcome.passed and outcome.metadata["leaking_rows"] == 4
    why = [leak["why"] for leak in outcome.metadata["first_leaks"]]
    assert why == [
        "held-out problem; held-out seed",
        "held-out problem",
        f"held-out seed; seed_id {HELDOUT[2]} but synthesized_problems says {TRAIN[1]}",
        "unknown problem (not in synthesized_problems)",
    ]


# -- through Dagster ---------------------------------------------------------------------------


def _write_upstream() -> list[str]:
    """Searched trees (the golden tree) for two training-side problems and one held-out one,
    their verified solutions, and the lineage; the problem ids."""
    ids = [TRAIN[0], TRAIN[1], HELDOUT[0]]
    config = MCTSConfig(rollouts=4, width=3, max_depth=4, errors_threshold=1)
    prompt = StepPrompt(lambda q: f"Question: {q}\n")
    with Sandbox(backend="process", workers=2) as sandbox:
        trees = search(
            [Problem(i, "What is 2 + 3?", "5") for i in ids],
            ScriptedPolicy(),
            sandbox,
            config,
            prompt=prompt,
        )
    nodes, problems, solutions = [], [], []
    for pid, tree in zip(ids, trees, strict=True):
        base = {"problem_id": pid, "seed_id": pid, "batch": "b1", "round": 1}
        extra = {"question": "What is 2 + 3?", "gold_answer": "5", "model": "scripted"}
        nodes += [{**base, **extra, **row} for row in tree.nodes.to_pylist()]
        problems.append(
            {"id": pid, "batch": "b1", "domain": "math", "problem": "What is 2 + 3?"}
            | {"is_seed": True, "seed_id": pid}
        )
        solutions.append(
            {"id": f"sol-{pid}", "problem_id": pid, "batch": "b1", "domain": "math"}
            | {
                "messages": [
                    {"role": "user", "content": "2 + 3?"},
                    {"role": "assistant", "content": "5"},
                ]
            }
        )
    lake = settings.lake_dir()
    for key, rows, schema in (
        ("mcts_nodes", nodes, schemas.MCTS_NODES),
        ("synthesized_problems", problems, schemas.SYNTHESIZED_PROBLEMS),
        ("verified_solutions", solutions, schemas.VERIFIED_SOLUTIONS),
    ):
        write_table(pa.Table.from_pylist(rows, schema=schema), lake / key / "b1.parquet")
    return ids


def _checks(result) -> dict[str, bool]:
    return {e.asset_key.path[-1]: e.passed for e in result.get_asset_check_evaluations()}


def test_training_tables_hold_no_heldout_problem_and_a_leak_stops_training(monkeypatch):
    defs = build_definitions(load_spec())
    train_a, train_b, heldout = _write_upstream()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["b1"])
        result = dg.materialize(
            list(defs.assets),
            selection=["sft_dataset", "ppm_pairs"],
            instance=instance,
            resources=dict(defs.resources),
        )
        assert result.success and _checks(result) == {"sft_dataset": True, "ppm_pairs": True}
        for table in ("sft_dataset", "ppm_pairs"):
            found = query(f"select distinct problem_id, seed_id from {table}").to_pylist()
            assert {r["problem_id"] for r in found} == {train_a, train_b}
            assert all(r["seed_id"] == r["problem_id"] for r in found)

        # A hand-made leak: the trees reach the stage unfiltered.
        def unfiltered(inputs, split):
            lineage = search_stages.seeds_of(inputs["synthesized_problems"])
            return search_stages.stored_trees(inputs["mcts_nodes"]), lineage, 0

        monkeypatch.setattr(search_stages, "training_trees", unfiltered)
        leaked = dg.materialize(
            list(defs.assets),
            selection=["sft_dataset", "policy_checkpoint"],
            instance=instance,
            resources=dict(defs.resources),
            raise_on_error=False,
        )
        assert not leaked.success and _checks(leaked) == {"sft_dataset": False}
        [evaluation] = leaked.get_asset_check_evaluations()
        assert evaluation.metadata["leaking_rows"].value == 2  # the held-out tree's two rows
        leaks = evaluation.metadata["first_leaks"].value
        assert {leak["problem_id"] for leak in leaks} == {heldout}
        materialized = {e.asset_key.path[-1] for e in leaked.get_asset_materialization_events()}
        assert materialized == {"sft_dataset"}  # the policy was never trained on it
