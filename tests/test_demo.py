"""Everything that shares the session's `rstar demo` run (the `demo` fixture), in one module
so that `make test`'s workers (xdist, --dist loadfile) run it once: its console, the graph it
materialized, and the UI in a real browser: `dagster dev` starts on the demo's home, the
lineage, verified_outputs and eval_comparison pages render with their metadata
(eval_comparison's plot included), a materialization launched from the UI succeeds, and the
sensors, which tick during the test, launch no other run within a minute."""

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import dagster as dg
import httpx
import pytest
from click.testing import CliRunner

from rstar_pipelines.cli import main
from rstar_pipelines.llm import SamplingParams, load_llm
from rstar_pipelines.problems import seeds_of
from rstar_pipelines.storage import query
from tests.fakes.dser import COMPARED_METHODS
from tests.fakes.repo import DAGSTER, REPO, dagster_cli
from tests.fakes.servers import free_port, stop

CHROMIUM = Path("/usr/bin/chromium")
# As the machine notes say works here: headless, and no background connections (the
# network is closed; without these flags Chromium keeps retrying them).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LOCATION = "rstar_pipelines"  # pyproject's [tool.dg] code_location_name
QUIET_MINUTE = 60


@pytest.fixture
def chromium() -> Path:
    """Debian's chromium: checked before the (long) demo fixture is asked for."""
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing in CI (.ci/run installs Debian's chromium)")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    return CHROMIUM


def _dismiss_welcome(page) -> None:
    """The UI greets a new browser profile with a newsletter dialog; skip it."""
    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(timeout=5_000)
    except Exception:  # playwright's TimeoutError: no dialog this time
        return
    skip.click()


def dg_defs():
    from rstar_pipelines.definitions import defs

    return defs


def _graphql(url: str, query: str, variables: dict | None = None) -> dict:
    response = httpx.post(f"{url}/graphql", json={"query": query, "variables": variables or {}})
    response.raise_for_status()
    return response.json()["data"]


SENSOR_TICKS = """
query ($name: String!) {
  sensorOrError(sensorSelector: {repositoryLocationName: "rstar_pipelines",
                                 repositoryName: "__repository__", sensorName: $name}) {
    ... on Sensor { sensorState { status ticks(limit: 10) { status timestamp } } }
  }
}
"""


def _ticks(url: str, sensor: str) -> list[dict]:
    found = _graphql(url, SENSOR_TICKS, {"name": sensor})["sensorOrError"]
    return found["sensorState"]["ticks"]


@pytest.fixture
def dagster_dev(chromium, demo, monkeypatch, tmp_path):
    """`dagster dev` on the demo's home and data, on a free loopback port."""
    assert demo.returncode == 0, demo.output[-3000:]
    demo.use(monkeypatch)
    port = free_port()
    log = (tmp_path / "dagster-dev.log").open("w")
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.Popen(
        [DAGSTER, "dev", "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"{url}/server_info", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "dagster dev did not start:\n" + (tmp_path / "dagster-dev.log").read_text()
                )
            time.sleep(1)
        yield url
    finally:
        # It takes up to a minute to stop its daemon and code servers itself; whatever of
        # them outlives it runs in sessions of its own, told apart by the demo's home in the
        # command line, and is killed below.
        stop(proc, timeout_s=5)
        log.close()
        listing = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True)
        for line in listing.stdout.splitlines():
            pid, args = line.strip().split(None, 1)
            if str(demo.home) in args and "ps -eo" not in args and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)


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
    budgets = {(1, "attn_gates", "budget_32"), (1, "attn_gates", "budget_64")}
    assert set(methods) == COMPARED_METHODS | budgets
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


@pytest.mark.slow
def test_the_ui_after_the_demo(chromium, demo, dagster_dev, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    url = dagster_dev
    started = time.time()
    with dg.DagsterInstance.get() as instance:
        runs_before = {r.run_id for r in instance.get_runs()}
    assert len(runs_before) >= 2  # the demo's batch_chain and aggregates

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        # The lineage view draws only the nodes inside the viewport: room for every group.
        page = browser.new_page(viewport={"width": 4800, "height": 3000})
        page.set_default_timeout(120_000)
        expect.set_options(timeout=120_000)  # the first page waits for the code location

        # The lineage, group by group: every asset's node, with its whole name.
        graph = dg_defs().resolve_asset_graph()
        groups: dict[str, list[str]] = {}
        for key in graph.get_all_asset_keys():
            groups.setdefault(graph.get(key).group_name, []).append(key.to_user_string())
        for group, keys in sorted(groups.items()):
            page.goto(f"{url}/locations/{LOCATION}/asset-groups/{group}/lineage")
            _dismiss_welcome(page)
            for key in keys:
                expect(page.get_by_text(key, exact=True).first).to_be_visible()
            page.screenshot(path=str(tmp_path / f"lineage-{group}.png"))

        # verified_outputs: its latest materialization's figures and its columns' meaning.
        page.goto(f"{url}/assets/verified_outputs?partition=demo")
        expect(page.get_by_text("synthesized_verification_rate").first).to_be_visible()
        expect(page.get_by_text("seed_problems", exact=True).first).to_be_visible()
        # Its columns, described by the data contract.
        expect(
            page.get_by_text("share of candidates that agree with the label").first
        ).to_be_visible()
        page.screenshot(path=str(tmp_path / "verified_outputs.png"))

        # eval_comparison: the verdict on significance, and the plot of accuracy by round and
        # method with its intervals, an inlined PNG the UI shows in a dialog.
        page.goto(f"{url}/assets/eval_comparison")
        _dismiss_welcome(page)
        expect(page.get_by_text("baseline at p < 0.05").first).to_be_visible()
        row = page.locator("tr", has=page.get_by_text("accuracy_by_round", exact=True))
        row.get_by_text("[Show Markdown]").click()
        plot = page.locator('img[alt="accuracy (95% Wilson interval) by round and method"]')
        expect(plot).to_be_visible()
        assert plot.evaluate("image => image.complete && image.naturalWidth") > 0
        page.screenshot(path=str(tmp_path / "eval_comparison.png"))
        page.get_by_role("button", name="Close").click()

        # Launch a materialization from the UI: seed_catalog (nothing downstream of it).
        page.goto(f"{url}/assets/seed_catalog")
        _dismiss_welcome(page)
        page.get_by_text("Materialize", exact=True).first.click()
        with dg.DagsterInstance.get() as instance:
            deadline = time.monotonic() + 240
            while True:
                new = [r for r in instance.get_runs() if r.run_id not in runs_before]
                if new and all(r.is_finished for r in new):
                    break
                assert time.monotonic() < deadline, "the UI's run did not finish"
                time.sleep(2)
        [launched] = new
        assert launched.status == dg.DagsterRunStatus.SUCCESS
        assert {k.to_user_string() for k in launched.asset_selection} == {"seed_catalog"}
        browser.close()

    # A minute of dagster dev: the sensors tick, and start nothing.
    time.sleep(max(0.0, started + QUIET_MINUTE - time.time()))
    for sensor in ("seed_problems_files", "rstar_automation"):
        ticks = _ticks(url, sensor)
        assert ticks, f"{sensor} never ticked"
        # Every finished tick skipped (a tick still being evaluated is STARTED).
        assert all(t["status"] == "SKIPPED" for t in ticks if t["status"] != "STARTED"), ticks
    with dg.DagsterInstance.get() as instance:
        after = [r for r in instance.get_runs() if r.run_id not in runs_before]
    assert [r.run_id for r in after] == [launched.run_id]
    # dagster dev moves $DAGSTER_HOME/logs away for its telemetry upload: the demo's is elsewhere.
    assert "STEP_SUCCESS" in demo.event_log.read_text()
