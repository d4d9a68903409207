import dagster as dg

from rstar_pipelines.sandbox_resource import SandboxResource
from rstar_sandbox import server
from tests.fakes.repo import host_processes_matching
from tests.fakes.sandbox import sums


def test_sandbox_resource_runs_jobs_in_an_asset_and_stops_after(monkeypatch):
    monkeypatch.setenv("RSTAR_SANDBOX_BACKEND", "process")
    resource = SandboxResource(workers=1)
    result = dg.materialize([sums], resources={"sandbox": resource})
    assert result.success
    [event] = result.get_asset_materialization_events()
    assert event.materialization.metadata["outputs"].value == ["3", "7"]
    # The pool was stopped when the step ended: no server process is left (the process
    # backend passes the server's source on its command line, docstring first).
    assert host_processes_matching(server.__doc__.splitlines()[0], ours=True) == []
