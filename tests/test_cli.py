import json
import math
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner

from rstar_pipelines.cli import main
from rstar_pipelines.llm import SamplingParams, load_llm
from rstar_pipelines.problems import seeds_of
from rstar_pipelines.storage import query
from tests.fakes.repo import DEMO_SEEDS, dagster_cli


def test_seeds_add_registers_the_partition(isolated_dirs):
    added = CliRunner().invoke(main, ["seeds", "add", str(DEMO_SEEDS), "--batch", "extra"])
    assert added.exit_code == 0, added.output
    assert (isolated_dirs / "seeds" / "incoming" / "extra.jsonl").exists()
    assert "dg launch --assets seed_problems,seed_rejects --partition extra" in added.output
    with dg.DagsterInstance.get() as instance:
        assert instance.has_dynamic_partition("seed_batches", "extra")


@pytest.mark.slow
def test_demo_console_fits_a_screen_per_stage(demo):
    """One line as each asset starts and one as it ends (rows and seconds), progress lines
    (not a terminal: every 10%), no Dagster events and no tqdm bars; the events are in the
    file it names, and the runs are the code location's named jobs."""
    assert demo.returncode == 0, demo.output[-3000:]
    lines = demo.output.splitlines()
    event_log = demo.event_log
    assert event_log.is_relative_to(demo.home) and event_log.stat().st_size > 0
    events = event_log.read_text()
    assert "STEP_SUCCESS" in events and "ASSET_MATERIALIZATION" in events
    assert "2 runs: batch_chain, aggregates" in demo.output
    for key in ("seed_problems[demo]", "verified_outputs[demo]", "policy_checkpoint"):
        assert f"▶ {key}" in lines
        [end] = [line for line in lines if line.startswith(f"✔ {key}: ")]
        assert " rows" in end and end.endswith(" s")
    assert any("candidate_solutions[demo]: " in line and "tokens/s" in line for line in lines)
    assert any("verified_outputs[demo]: " in line and "sandbox jobs/s" in line for line in lines)
    # It ends with the evaluation, as `rstar eval` prints it.
    assert "eval_comparison: " in demo.output and "| round | checkpoint | method |" in demo.output
    assert "baseline at p < 0.05" in demo.output and "An oracle, not a method" in demo.output
    for noise in ("DEBUG", "STEP_START", "de-quantizing", "it/s]"):
        assert noise not in demo.output


@pytest.mark.slow
def test_demo_materializes_the_graph(demo, monkeypatch):
    """The demo's outputs, every asset there and consistent with its upstream. The 135M
    model solves little, so few rows survive verification."""
    assert demo.returncode == 0, demo.output[-3000:]
    demo.use(monkeypatch)
    isolated_dirs = demo.data
    runner = CliRunner()
    out = runner.invoke(
        main, ["query", "select batch, math_problems from seed_catalog", "--format", "json"]
    )
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.output.splitlines()]
    assert rows == [{"batch": "demo", "math_problems": rows[0]["math_problems"]}]
    assert rows[0]["math_problems"] > 20

    counts = query(
        "select (select count(*) from seed_problems) seeds,"
        " (select count(*) from synthesized_problems where is_seed) carried,"
        " (select count(*) from synthesized_problems) problems,"
        " (select count(*) from test_inputs) code_problems,"
        " (select count(*) from synthesized_problems where domain = 'code') code_rows,"
        " (select count(*) from candidate_solutions) candidates,"
        " (select count(*) from verified_outputs) outcomes,"
        " (select count(*) from verified_outputs where label_source = 'oracle') oracle_labelled,"
        " (select count(*) from verified_solutions) solutions,"
        " (select count(*) from verified_outputs, unnest(candidates) as t(c)"
        "  where c.agrees) agreeing"
    ).to_pylist()[0]
    assert counts["carried"] == counts["seeds"] == 50
    assert counts["code_problems"] == counts["code_rows"] >= 10
    assert counts["candidates"] == 3 * counts["problems"]
    assert counts["outcomes"] == counts["problems"]
    assert counts["oracle_labelled"] == 10  # every code seed is labelled by its oracle
    assert counts["solutions"] == counts["agreeing"]
    _check_rstar_math(isolated_dirs)
    _check_heldout_split()
    _check_seer_attention(isolated_dirs)
    _check_evaluations()
    _check_grpo_roc()


def _check_rstar_math(data_dir: Path) -> None:
    """The search, its pairs and both checkpoints from the demo run, then ppm_pairs
    rebuilt on its own through the dagster CLI."""
    search = query(
        "select (select count(distinct problem_id) from mcts_nodes) trees,"
        " (select count(*) from mcts_nodes where kind = 'answer' and correct) correct,"
        " (select count(*) from mcts_trajectories) trajectories,"
        " (select count(*) from ppm_pairs) pairs,"
        " (select count(*) from sft_dataset) sft,"
        " (select count(*) from verified_solutions) solutions"
    ).to_pylist()[0]
    assert search["trees"] == 8
    assert search["correct"] >= 1 and search["pairs"] >= 1  # the demo batch's easy problems
    assert search["sft"] >= search["solutions"]
    pair = query("select prompt, chosen, rejected, margin from ppm_pairs limit 1").to_pylist()[0]
    assert pair["margin"] >= 0.5 and pair["chosen"] != pair["rejected"]

    policy = query("select * from policy_checkpoint").to_pylist()[0]
    ppm = query("select * from ppm_checkpoint").to_pylist()[0]
    assert Path(policy["path"]).is_relative_to(data_dir)
    assert ppm["base_model"] == policy["path"] and math.isfinite(ppm["final_loss"])
    reloaded = load_llm("transformers", policy["path"])
    greedy = SamplingParams(temperature=0, max_tokens=4)
    assert reloaded.generate(["<code>\n"], greedy)[0][0].completion_tokens >= 1

    evaluated = query("select count(*) n from mcts_eval").column("n")[0].as_py()
    assert evaluated >= 1

    before = query("select id from ppm_pairs order by id").column("id").to_pylist()
    proc = dagster_cli(
        "asset", "materialize", "--select", "ppm_pairs", "-m", "rstar_pipelines.definitions"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert query("select id from ppm_pairs order by id").column("id").to_pylist() == before


TRAINING_TABLES = {
    "sft_dataset": "problem_id",
    "ppm_pairs": "problem_id",
    "grpo_roc_data": "id",
    "gate_distill_data": "problem_id",
}


def _check_heldout_split() -> None:
    """No training table (nor the search that feeds them) holds a held-out problem or a problem
    synthesized from a held-out seed, as the split itself says; every training table's blocking
    check passed; every evaluation holds held-out problems only."""
    from rstar_pipelines.definitions import load_spec

    split = load_spec().by_key["sft_dataset"].params.heldout
    seed_of = seeds_of(query("select id, seed_id from synthesized_problems"))
    sides = {}
    for table, column in {
        **TRAINING_TABLES,
        "mcts_nodes": "problem_id",
        "base_policy_eval": "problem_id",
        "mcts_eval": "problem_id",
        "dser_eval": "problem_id",
        "grpo_eval": "problem_id",
    }.items():
        ids = query(f"select distinct {column} p from {table} where {column} is not null")
        sides[table] = {split.is_heldout(seed_of[i]) for i in ids.column("p").to_pylist()}
    assert all(sides[t] == {False} for t in [*TRAINING_TABLES, "mcts_nodes"]), sides
    evaluations = ("base_policy_eval", "mcts_eval", "dser_eval", "grpo_eval")
    assert all(sides[t] == {True} for t in evaluations), sides
    with dg.DagsterInstance.get() as instance:
        for table in TRAINING_TABLES:
            key = dg.AssetCheckKey(dg.AssetKey(table), "no_heldout_problems")
            record = instance.get_latest_asset_check_evaluation_record(key)
            assert record is not None and record.event.asset_check_evaluation.passed, table


def _check_seer_attention(data_dir: Path) -> None:
    """The demo's gates for the embedded model: trained (held-out recall rises), reloadable,
    and sparse decoding with a budget that covers the context generates what dense does."""
    from rstar_kernels import SeerGates

    texts = query("select count(*) n from gate_distill_data").column("n")[0].as_py()
    gate = query("select * from attn_gate_checkpoint").to_pylist()[0]
    # Training side only: the oracle-solved code seeds and verified solutions outside the split.
    assert texts >= 5 and Path(gate["path"]).is_relative_to(data_dir)
    assert gate["heldout_recall_after"] > gate["heldout_recall_before"]
    assert SeerGates.load(gate["path"]).config.num_layers == 30

    prompt = [{"role": "user", "content": "Count from one to twenty in words, comma-separated."}]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    dense = load_llm("transformers", "embedded").generate([prompt], greedy)[0][0]
    sparse = load_llm(
        "transformers",
        "embedded",
        sparse_attention="seer",
        gate_checkpoint=gate["path"],
        token_budget=4096,
    ).generate([prompt], greedy)[0][0]
    assert sparse.text == dense.text and dense.completion_tokens == 24


def _check_evaluations() -> None:
    """DSER on the held-out problems (2 chains, 2 iterations: 3 states per chain) with its
    Markov diagnostics, and the four methods compared on the math problems both evaluations
    share."""
    rows = query("select * from dser_eval").to_pylist()
    assert rows and {r["domain"] for r in rows} <= {"math", "code"}
    for row in rows:
        assert len(row["states"]) == 2 * 3 and row["calls"] >= 2 + 2 * 2
        transitions = sum(row[f"transitions_{k}"] for k in ("cc", "ci", "ic", "ii"))
        assert transitions == 2 * 2 and row["tokens"] > 0 and row["seconds"] > 0
        assert row["observed_accuracy"] == sum(
            s["correct"] for s in row["states"] if s["iteration"] >= 1
        ) / (2 * 2)
    # The base policy (round 0) and every trained checkpoint, each way it is evaluated, on the
    # same held-out problems; each with its interval, and paired with round 0.
    rows = query("select * from eval_comparison").to_pylist()
    methods = {(r["round"], r["checkpoint"], r["method"]): r for r in rows}
    assert set(methods) == {
        (0, "policy", "greedy"),
        (0, "policy", "majority_of_4"),
        (0, "policy", "mcts_majority"),
        (1, "policy", "greedy"),
        (1, "policy", "majority_of_4"),
        (1, "policy", "dser"),
        (1, "policy+ppm", "mcts_best_q"),
        (1, "policy+ppm", "mcts_majority"),
        (1, "grpo_roc", "greedy"),
        (1, "grpo_roc", "tool"),
        (1, "attn_gates", "dense"),
        (1, "attn_gates", "budget_32"),
        (1, "attn_gates", "budget_64"),
    }
    assert len({r["problems"] for r in rows}) == 1 and rows[0]["problems"] >= 1
    assert all(r["tokens_per_problem"] > 0 for r in rows)
    assert all(r["accuracy_low"] <= r["accuracy"] <= r["accuracy_high"] for r in rows)
    assert all((r["p_value"] is None) == (r["baseline"] is None) for r in rows)
    dser, greedy = methods[1, "policy", "dser"], methods[1, "policy", "greedy"]
    assert dser["tokens_per_problem"] > greedy["tokens_per_problem"]
    # The search never reads the gold answer: the PPM values every answer step it reaches (the
    # demo's weak policy may reach none).
    searched = query("select search_answers, answers_valued_by_ppm from mcts_eval").to_pylist()
    assert searched and all(r["answers_valued_by_ppm"] >= r["search_answers"] for r in searched)
    gates = {r["setting"]: r for r in query("select * from attn_gate_eval").to_pylist()}
    assert set(gates) == {"dense", "budget 32", "budget 64"}
    assert gates["dense"]["kl"] is None and gates["budget 32"]["kl"] is not None
    steps = {r["decode_steps"] for r in gates.values()}
    assert len(steps) == 1 and steps.pop() > 64  # the budgets are smaller than the texts


def _check_grpo_roc() -> None:
    """GRPO-RoC from the demo's policy checkpoint: its steps' figures and a checkpoint that
    generates."""
    policy = query("select path from policy_checkpoint").column("path")[0].as_py()
    grpo = query("select * from grpo_roc_checkpoint").to_pylist()[0]
    assert grpo["job"] == "grpo" and grpo["base_model"] == policy and grpo["steps"] == 2
    # A mean of binary rewards over a step's rollouts (2 prompts x 4, or 1 x 4).
    assert (grpo["mean_reward_first"] * 8).is_integer() and (
        grpo["mean_reward_last"] * 8
    ).is_integer()
    greedy = SamplingParams(temperature=0, max_tokens=4)
    reloaded = load_llm("transformers", grpo["path"])
    assert reloaded.generate(["<answer>"], greedy)[0][0].completion_tokens >= 1


def test_eval_prints_the_latest_comparison(isolated_dirs):
    """`rstar eval`: the last materialization's table, verdict and oracle; a clear error
    before there is one."""
    from rstar_pipelines.dser.comparison import Evaluated, Outcome, compare, report

    runner = CliRunner()
    missing = runner.invoke(main, ["eval"])
    assert missing.exit_code != 0 and "no eval_comparison is materialized" in missing.output
    right, wrong = Outcome(True, 12, 0.5, 4, True), Outcome(False, 12, 0.5, 4, False)
    rows = compare(
        [
            Evaluated(0, "policy", "greedy", "base", [Outcome(False, 3, 0.1, 1)] * 7),
            Evaluated(1, "policy", "majority_of_4", "sft", [right] * 6 + [wrong]),
        ]
    )
    metadata = {"problems": 7, **report(rows)}
    with dg.DagsterInstance.get() as instance:
        for problems in (2, 7):  # the latest one is shown
            event = dg.AssetMaterialization(
                "eval_comparison",
                metadata={
                    k: dg.MetadataValue.md(v) if k != "problems" else problems
                    for k, v in metadata.items()
                },
            )
            instance.report_runless_asset_event(event)
    shown = runner.invoke(main, ["eval"])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0] == "eval_comparison: 7 held-out problems"
    assert "| 0 | policy | greedy | 0/7 | 0.000 [0.000, 0.354] |  |  |  | 1.0 | 3 | 0.10 |" in lines
    # 6 of 7 gained over round 0's greedy decoding: p = 2 * 1 / 2^6.
    assert any(line.startswith("| 1 | policy | majority_of_4 | 6/7 | 0.857") for line in lines)
    assert any("round 0 greedy | +0.857 | 0.0312 |" in line for line in lines)
    assert "1 of 1 rows differ from their baseline at p < 0.05" in shown.output
    assert "An oracle, not a method" in shown.output
    assert "| 1 | policy | majority_of_4 | 4.0 | 0.857 |" in lines


def test_query_errors_are_clear(isolated_dirs):
    result = CliRunner().invoke(main, ["query", "select * from no_such_asset"])
    assert result.exit_code != 0
    assert "no_such_asset" in result.output and "Parquet files under" in result.output


def test_sandbox_run(tmp_path):
    program = tmp_path / "add.py"
    program.write_text("a, b = map(int, input().split())\nprint(a + b)\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("20 22\n")
    runner = CliRunner()
    result = runner.invoke(
        main, ["sandbox", "run", str(program), "--stdin", str(stdin), "--backend", "process"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("42\n")
    assert "[ok] exit 0" in result.stderr

    program.write_text("raise SystemExit(4)")
    failed = runner.invoke(main, ["sandbox", "run", str(program), "--backend", "process"])
    assert failed.exit_code == 1 and "[runtime_error] exit 4" in failed.stderr
