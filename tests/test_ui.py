"""The UI in a real browser, after `rstar demo` (the session's shared demo run): `dagster dev`
starts on the demo's home, the lineage, verified_outputs and eval_comparison pages render
with their metadata (eval_comparison's plot included), a materialization launched from the
UI succeeds, and the sensors, which tick during the test, launch no other run within a
minute."""

import os
import signal
import subprocess
import time
from pathlib import Path

import dagster as dg
import httpx
import pytest

from tests.fakes.repo import DAGSTER, REPO
from tests.fakes.servers import free_port

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
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        # Its code servers and daemon may outlive it (they run in sessions of their own);
        # they are told apart by the demo's home in their command line.
        listing = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True)
        for line in listing.stdout.splitlines():
            pid, args = line.strip().split(None, 1)
            if str(demo.home) in args and "ps -eo" not in args and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)


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
