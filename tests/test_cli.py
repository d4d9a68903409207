import dagster as dg
from click.testing import CliRunner

from rstar_pipelines.cli import main
from tests.fakes.repo import DEMO_SEEDS


def test_seeds_add_registers_the_partition(isolated_dirs):
    added = CliRunner().invoke(main, ["seeds", "add", str(DEMO_SEEDS), "--batch", "extra"])
    assert added.exit_code == 0, added.output
    assert (isolated_dirs / "seeds" / "incoming" / "extra.jsonl").exists()
    assert "dg launch --assets seed_problems,seed_rejects --partition extra" in added.output
    with dg.DagsterInstance.get() as instance:
        assert instance.has_dynamic_partition("seed_batches", "extra")


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
