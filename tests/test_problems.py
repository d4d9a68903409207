"""The held-out split and the check that keeps it out of every training table: by hand, and
through Dagster, where a hand-made leak fails the blocking check and stops the training after
it."""

from __future__ import annotations

import dagster as dg
import pyarrow as pa
import pytest

from rstar_pipelines import settings
from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.heldout import HeldoutSplit, normalized_answer, normalized_text
from rstar_pipelines.math import search_stages
from rstar_pipelines.math.mcts import MCTSConfig, Problem, StepPrompt, search
from rstar_pipelines.problems import (
    ProblemFreeSource,
    near_duplicate_groups,
    no_heldout_check,
)
from rstar_pipelines.storage import query, schemas
from rstar_pipelines.storage.parquet_io import write_table
from rstar_sandbox import Sandbox
from tests.fakes.math import StepPolicy

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
    groups = {**{i: i for i in IDS}, child: HELDOUT[0]}
    clean = [{"problem_id": TRAIN[0], "seed_id": TRAIN[0]}]
    outcome = no_heldout_check(clean, groups, SPLIT)
    assert outcome.passed and outcome.metadata["rows_without_a_problem"] == 0
    leaks = [
        {"problem_id": HELDOUT[1], "seed_id": HELDOUT[1]},  # a held-out problem
        {"problem_id": child, "seed_id": None},  # held out by its group (its seed's)
        {"problem_id": TRAIN[1], "seed_id": HELDOUT[2]},  # a seed that is held out, and wrong
        {"problem_id": "never-synthesized", "seed_id": TRAIN[3]},  # lineage unknown
    ]
    outcome = no_heldout_check(clean + leaks, groups, SPLIT)
    assert not outcome.passed and outcome.metadata["leaking_rows"] == 4
    why = [leak["why"] for leak in outcome.metadata["first_leaks"]]
    assert why == [
        "held-out problem; held-out seed",
        "held-out problem",
        f"held-out seed; seed {HELDOUT[2]} is in group {HELDOUT[2]}, its problem in {TRAIN[1]}",
        "unknown problem (not in problem_groups)",
    ]


def test_a_row_without_a_problem_is_blocked_unless_its_source_is_declared_problem_free():
    groups = {i: i for i in IDS}
    named = {"id": "t0", "source": "mcts", "problem_id": TRAIN[0], "seed_id": TRAIN[0]}
    nameless = {"id": "t1", "source": "file", "problem_id": None, "seed_id": None}
    outcome = no_heldout_check([named, {**nameless, "text": "a poem"}], groups, SPLIT)
    assert not outcome.passed and outcome.metadata["rows_without_a_problem"] == 1
    [leak] = outcome.metadata["first_leaks"]
    assert leak == {"id": "t1", "why": "names no problem (problem-free source declared: none)"}

    question = "A train leaves at 3 pm going 60 miles per hour. How far has it gone by 5 pm?"
    files = ProblemFreeSource("file", {HELDOUT[0]: question})
    other = {**nameless, "source": "elsewhere", "text": "a poem"}
    outcome = no_heldout_check(
        [{**nameless, "text": "a poem"}, other], groups, SPLIT, **{"problem_free": files}
    )
    assert [leak["id"] for leak in outcome.metadata["first_leaks"]] == ["t1"]  # the undeclared
    assert "declared: source 'file'" in outcome.metadata["first_leaks"][0]["why"]

    # The declared source is proven clean against every held-out problem's text: one quoted
    # with other case and spacing inside a longer text is caught, as is one in a chat.
    copied = (
        "Exercise:  a TRAIN leaves at 3 pm, going 60 miles per hour;\nhow far has it gone by 5 pm"
    )
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": "120"}]
    rows = [
        {**nameless, "text": "The mitochondria is the powerhouse of the cell."},
        {**nameless, "id": "t2", "text": f"Some notes. {copied} The end."},
        {**nameless, "id": "t3", "text": None, "messages": chat},
    ]
    outcome = no_heldout_check(rows, groups, SPLIT, problem_free=files)
    assert not outcome.passed
    assert [leak["id"] for leak in outcome.metadata["first_leaks"]] == ["t2", "t3"]
    assert f"held-out problem {HELDOUT[0]}'s text" in outcome.metadata["first_leaks"][0]["why"]
    assert no_heldout_check(rows[:1], groups, SPLIT, problem_free=files).passed


def _seed(pid: str, problem: str, answer: str | None, seed_id: str | None = None) -> dict:
    return {
        "id": pid,
        "domain": "math",
        "problem": problem,
        "answer": answer,
        "is_seed": seed_id is None,
        "seed_id": seed_id or pid,
    }


def test_near_duplicates_across_batches_form_one_group_on_one_side():
    # Pairs of ids that the split by seed id alone puts on both sides; the smaller id of each
    # (the group's key) is the held-out one, so their groups are held out.
    a, b = HELDOUT[0], next(t for t in TRAIN if t > HELDOUT[0])
    c, d = HELDOUT[1], next(t for t in TRAIN if t > HELDOUT[1] and t != b)
    e, f = TRAIN[-1], HELDOUT[-1]
    question = "Sam buys 3 boxes of 12 eggs and breaks 4 of them. How many eggs are left unbroken?"
    problems = [
        _seed(a, "What is 17 times 23?", "391"),  # batch 1
        _seed(b, "  what is 17 TIMES 23 ", "391.0"),  # batch 2: the same, its answer 391.0
        _seed(c, question, "32"),  # batch 1
        # batch 2: a paraphrase of c that the synthesizer wrote from another seed, d
        _seed("para", question.replace("Sam buys", "Sam has bought"), None, seed_id=d),
        _seed(d, "Name a prime number larger than 100.", None),
        _seed(e, "What is 17 times 24?", "408"),  # alike in text, another answer: another one
        _seed(f, "Write the number one thousand in digits.", "1,000"),
    ]
    grouped = near_duplicate_groups(problems, SPLIT.similarity)
    groups = {pid: g.group for pid, g in grouped.items()}
    assert groups[a] == groups[b] == a and grouped[b].duplicate_of == a
    assert grouped[b].similarity == 1.0
    assert groups["para"] == groups[c] == groups[d] == c and grouped["para"].duplicate_of == c
    assert SPLIT.similarity <= grouped["para"].similarity < 1
    assert (groups[e], groups[f], grouped[e].duplicate_of) == (e, f, None)

    # Rows of the training-side twins: the split by seed id let them through; by group, the
    # blocking check stops them.
    rows = [{"problem_id": b, "seed_id": b}, {"problem_id": "para", "seed_id": d}]
    by_seed = {r["id"]: r["seed_id"] for r in problems}
    assert no_heldout_check(rows, by_seed, SPLIT).passed
    outcome = no_heldout_check(rows, groups, SPLIT)
    assert not outcome.passed and outcome.metadata["leaking_rows"] == 2
    assert {leak["why"] for leak in outcome.metadata["first_leaks"]} == {
        "held-out problem; held-out seed"
    }


def test_answers_and_texts_normalize_as_duplicates_share_them():
    assert normalized_answer("391.0") == normalized_answer(" 391 ") == "391"
    assert normalized_answer("1,000") == normalized_answer("$1000.00") == "1000"
    assert normalized_answer("X  +  1") == normalized_answer("x + 1") == "x + 1"
    assert normalized_answer("  ") is None
    assert normalized_text("What  is 3.5 - 1?") == "what is 3 5 - 1"


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
            StepPolicy(),
            sandbox,
            config,
            prompt=prompt,
        )
    nodes, problems, solutions = [], [], []
    # Three distinct problems in the lineage (the same text would make them one group).
    texts = dict(zip(ids, ["What is 2 + 3?", "Add two and three.", "Sum 2 with 3."], strict=True))
    for pid, tree in zip(ids, trees, strict=True):
        base = {"problem_id": pid, "seed_id": pid, "batch": "b1", "round": 1}
        extra = {"question": "What is 2 + 3?", "gold_answer": "5", "model": "scripted"}
        nodes += [{**base, **extra, **row} for row in tree.nodes.to_pylist()]
        problems.append(
            {"id": pid, "batch": "b1", "domain": "math", "problem": texts[pid]}
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
            selection=["problem_groups", "sft_dataset", "ppm_pairs"],
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
            groups = search_stages.groups_of(inputs["problem_groups"])
            return search_stages.stored_trees(inputs["mcts_nodes"]), groups, 0

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


def test_problem_groups_join_the_same_problem_across_seed_batches():
    """Two seed batches hold one problem (its answer 5 in one, 5.0 in the other): one group,
    on one side, and the asset says which groups span batches."""
    defs = build_definitions(load_spec())
    lake = settings.lake_dir()
    batches = {
        "b1": [_seed(TRAIN[0], "Ann has 2 pens and buys 3. How many pens?", "5")],
        "b2": [
            _seed(HELDOUT[0], "ann has 2 pens and  buys 3 -- how many pens", "5.0"),
            _seed(TRAIN[1], "What is the capital of France?", None),
        ],
    }
    for batch, rows in batches.items():
        rows = [{**r, "batch": batch} for r in rows]
        table = pa.Table.from_pylist(rows, schema=schemas.SYNTHESIZED_PROBLEMS)
        write_table(table, lake / "synthesized_problems" / f"{batch}.parquet")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", list(batches))
        result = dg.materialize(
            list(defs.assets),
            selection=["problem_groups"],
            instance=instance,
            resources=dict(defs.resources),
        )
        assert result.success
        [event] = result.get_asset_materialization_events()
        metadata = event.materialization.metadata
        assert metadata["groups_across_batches"].value == 1
        assert (metadata["groups"].value, metadata["near_duplicates"].value) == (2, 2)
    rows = query("select * from problem_groups order by problem_id").to_pylist()
    twins = [r for r in rows if r["problem_id"] in (TRAIN[0], HELDOUT[0])]
    assert {r["group_id"] for r in twins} == {min(TRAIN[0], HELDOUT[0])}
    assert len({r["heldout"] for r in twins}) == 1 and all(r["group_size"] == 2 for r in twins)
