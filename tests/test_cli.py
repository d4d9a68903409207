import json

import dagster as dg
from click.testing import CliRunner

from rstar_pipelines.cli import main
from tests.conftest import DEMO_SEEDS


def test_seeds_add_registers_the_partition_and_demo_materializes_the_graph(isolated_dirs):
    runner = CliRunner()
    added = runner.invoke(main, ["seeds", "add", str(DEMO_SEEDS), "--batch", "extra"])
    assert added.exit_code == 0, added.output
    assert (isolated_dirs / "seeds" / "incoming" / "extra.jsonl").exists()
    with dg.DagsterInstance.get() as instance:
        assert instance.has_dynamic_partition("seed_batches", "extra")

    demo = runner.invoke(main, ["demo"])
    assert demo.exit_code == 0, demo.output
    assert "seed_catalog" in demo.output and "rstar query" in demo.output

    out = runner.invoke(
        main, ["query", "select batch, math_problems from seed_catalog", "--format", "json"]
    )
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.output.splitlines()]
    assert rows == [{"batch": "demo", "math_problems": rows[0]["math_problems"]}]
    assert rows[0]["math_problems"] > 20


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
