"""A materialization killed midway, then re-run, reuses the items it had finished:
the real embedded model through the real `dagster` CLI, killed with SIGKILL."""

import json
import os
import signal
import sqlite3
import subprocess
import time

import dagster as dg
import pytest

from tests.fakes.repo import DAGSTER, IN_PROCESS_RUN, REPO, pipeline_copy

MATH = [f"What is {a} plus {b}?" for a, b in [(2, 3), (4, 4), (10, 7), (6, 9), (12, 30), (8, 1)]]


def _materialize_command(selection: str) -> list[str]:
    return [
        DAGSTER,
        "asset",
        "materialize",
        "--select",
        selection,
        "--partition",
        "r",
        "-m",
        "rstar_pipelines.definitions",
        "--config-json",
        IN_PROCESS_RUN,
    ]


def _cached_items(path) -> int:
    if not path.exists():
        return 0
    with sqlite3.connect(path) as db:
        try:
            return db.execute("select count(*) from items").fetchone()[0]
        except sqlite3.OperationalError:  # the run has created the file, not yet the table
            return 0


@pytest.mark.slow
def test_killed_run_reuses_finished_items(tmp_path, incoming, isolated_dirs):
    (incoming / "r.jsonl").write_text(
        "\n".join(json.dumps({"problem": p, "answer": "0"}) for p in MATH) + "\n"
    )
    # The declared pipeline with fewer samples, so the run is short.
    fewer = {
        "synthesized_problems": {"max_seeds_per_domain": 0},
        "candidate_solutions": {"sampling": {"n": 2, "max_tokens": 48}},
    }
    # One prompt per generate call: each problem's completions are committed as they come.
    env = {
        **os.environ,
        "RSTAR_ASSETS_DIR": str(pipeline_copy(tmp_path, fewer)),
        "RSTAR_LLM_BATCH_SIZE": "1",
    }
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("seed_batches", ["r"])
    prep = _materialize_command("seed_problems,seed_rejects,synthesized_problems")
    subprocess.run(prep, env=env, cwd=REPO, check=True, capture_output=True, timeout=300)

    cache = isolated_dirs / "cache" / "candidate_solutions" / "r.sqlite"  # one file a partition
    run = _materialize_command("candidate_solutions")
    proc = subprocess.Popen(
        run,
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while _cached_items(cache) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = _cached_items(cache)
    assert 2 <= finished < len(MATH), "the kill should land mid-partition"

    rerun = subprocess.run(run, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    with dg.DagsterInstance.get() as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("candidate_solutions"))
    metadata = event.asset_materialization.metadata
    assert metadata["cache_hits"].value == finished
    assert metadata["cache_misses"].value == len(MATH) - finished
    assert metadata["candidates"].value == 2 * len(MATH)
