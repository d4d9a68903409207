"""The sandbox service (`rstar sandbox serve`) and `Sandbox(backend="http")`: real
services on loopback, a real haproxy in front, one service killed mid-batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import dagster as dg
import httpx
import psutil
import pytest

from rstar_pipelines.sandbox_resource import SandboxResource
from rstar_sandbox import OK, Job, Result, Sandbox
from rstar_sandbox.http_client import HttpSandbox
from rstar_sandbox.jobs import (
    BATCH_PATH,
    REPLAYED_HEADER,
    STREAM_TYPE,
    encode_batch,
    parse_result_line,
)
from rstar_sandbox.service import RequestError, SandboxService, make_server, parse_batch
from tests.fakes.sandbox import GatedSandbox, sums
from tests.fakes.servers import BIN, free_port, haproxy, require, sandbox_service, stop

ECHO = "print(input())\n"


@pytest.fixture(scope="module", autouse=True)
def process_backend():
    if os.geteuid() != 0 and not os.path.exists("/proc/self/ns/user"):
        pytest.skip("the process backend needs root or user namespaces")
    require("unshare")


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (over its labels) at `url`."""
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def _run_threads(sb, jobs: list[Job], threads: int) -> list:
    """The jobs split over `threads` callers, results rejoined in job order."""
    share = len(jobs) // threads
    parts = [jobs[i * share : (i + 1) * share] for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        return [r for part in pool.map(sb.run, parts) for r in part]


def test_failover_behind_haproxy_every_result_once_in_order():
    a, url_a = sandbox_service("--workers", "2")
    b, url_b = sandbox_service("--workers", "2")
    try:
        with haproxy([url_a.removeprefix("http://"), url_b.removeprefix("http://")]) as lb:
            jobs = [Job(code=ECHO, stdin=f"{i}\n", timeout_s=5.0) for i in range(2000)]
            with Sandbox(backend="http", urls=[lb], batch_size=25, workers=8) as sb:
                killed = threading.Event()

                def kill_a_mid_batch() -> None:
                    # Its pool, listed before the wait: the kill follows the look at its queue
                    # at once, before the batches seen there can finish.
                    workers = psutil.Process(a.pid).children(recursive=True)
                    # Mid-batch: it has done some work and has batches under way.
                    while (
                        metric(url_a, "rstar_sandbox_jobs_total") < 200
                        or metric(url_a, "rstar_sandbox_queued_jobs") == 0
                    ):
                        time.sleep(0.02)
                    os.killpg(a.pid, signal.SIGKILL)  # the host dies, its pool with it
                    psutil.wait_procs(workers, timeout=10)
                    killed.set()

                killer = threading.Thread(target=kill_a_mid_batch)
                killer.start()
                results = _run_threads(sb, jobs, threads=16)
                killer.join()
        assert killed.is_set()
        assert len(results) == len(jobs)
        assert [r.status for r in results] == [OK] * len(jobs)
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(len(jobs))]
        reruns = [i for i, r in enumerate(results) if r.attempts > 1]
        # Only jobs of the batches in flight on the dead host ran again, and say so: the
        # results it streamed before it died stand, each once.
        assert reruns and len({i // 25 for i in reruns}) <= sb.workers
        executed_b = metric(url_b, "rstar_sandbox_jobs_total")
        assert len(jobs) / 2 < executed_b <= len(jobs)
    finally:
        stop(a)
        stop(b)


def test_full_queue_answers_429_and_the_client_backs_off():
    proc, url = sandbox_service("--workers", "1", "--max-queue", "8")
    try:
        reply = httpx.post(f"{url}{BATCH_PATH}", json={"id": "big", "jobs": [{"code": "pass"}] * 9})
        assert reply.status_code == 413 and "smaller batches" in reply.json()["error"]
        slow = Job(code="import time; time.sleep(0.2); print(input())\n", stdin="x\n")
        with ThreadPoolExecutor(4) as pool:
            # Two raw batches fill the queue, two more wait for room beside it (as many jobs
            # again); a fifth is refused at once with a Retry-After.
            busy = [
                pool.submit(
                    httpx.post,
                    f"{url}{BATCH_PATH}",
                    timeout=60,
                    json={"id": f"fill{i}", "jobs": [{"code": slow.code, "stdin": "x\n"}] * 4},
                )
                for i in range(4)
            ]
            time.sleep(0.3)
            refused = httpx.post(
                f"{url}{BATCH_PATH}", json={"id": "fifth", "jobs": [{"code": "pass"}]}
            )
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            assert [f.result().status_code for f in busy] == [200] * 4  # the waiting ones too
        jobs = [Job(code=ECHO, stdin=f"{i}\n") for i in range(48)]
        with HttpSandbox(urls=[url], batch_size=4, workers=8) as sb:
            results = _run_threads(sb, jobs, threads=4)
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(48)]
        assert sb.stats["backoffs"] > 0  # it was told to wait, and waited
        # Exactly once: every job ran one time, however often it was refused first.
        assert metric(url, "rstar_sandbox_jobs_total") == 4 * 4 + 48
        assert metric(url, "rstar_sandbox_batches_rejected_total") >= sb.stats["backoffs"]
    finally:
        stop(proc)


SIZES = (("a", 4), ("b", 2))


def test_a_batch_waits_for_room_and_a_retry_of_it_joins_its_run():
    sb = GatedSandbox()
    service = SandboxService(sb, max_queue=4)
    jobs = {name: [Job(code=ECHO, stdin=f"{name}{i}\n") for i in range(n)] for name, n in SIZES}

    def until(what: str, value: int) -> None:
        deadline = time.monotonic() + 10
        while service.health()[what] != value:
            assert time.monotonic() < deadline, f"{what} never reached {value}"
            time.sleep(0.01)

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(service.run_batch, "a", jobs["a"], "digest-a")
        until("queued_jobs", 4)
        # The queue is full: b waits for room, and so does its retry (a dropped connection);
        # the waiting room (as many jobs as the queue) then has no room for a third batch.
        held = [pool.submit(service.run_batch, "b", jobs["b"], "digest-b") for _ in range(2)]
        until("waiting_jobs", 4)
        with pytest.raises(RequestError) as refused:
            service.run_batch("c", jobs["b"][:1], "digest-c")
        assert refused.value.status == 429 and int(refused.value.headers["Retry-After"]) >= 1
        sb.gate.set()  # a ends: b runs at once, once
        assert first.result()[0] == [Result(OK, 0, j.stdin, "", 0.0, 0.0, 0.0) for j in jobs["a"]]
        answers = [h.result() for h in held]
    assert answers[0][0] == answers[1][0] and sorted(r for _, r in answers) == [False, True]
    assert sb.ran == jobs["a"] + jobs["b"]
    assert service.health()["waiting_jobs"] == 0


@pytest.fixture(scope="module")
def local_service():
    """A service in this process, with a token, on a free loopback port."""
    with Sandbox(backend="process", workers=1) as sb:
        service = SandboxService(sb, token="s3cret")
        server = make_server(service, "127.0.0.1", free_port())
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield service, f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()
        server.server_close()


def test_token_bad_jobs_and_replayed_batches(local_service):
    service, url = local_service
    auth = {"Authorization": "Bearer s3cret"}
    batch = {"id": "b1", "jobs": [{"code": ECHO, "stdin": "7\n"}]}
    assert httpx.post(f"{url}{BATCH_PATH}", json=batch).status_code == 401
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/health").json()["status"] == "ok"  # for load balancers
    bad = {"id": "b0", "jobs": [{"code": "pass"}, {"code": "pass", "timeout_s": -1}]}
    reply = httpx.post(f"{url}{BATCH_PATH}", json=bad, headers=auth)
    assert reply.status_code == 400 and reply.json()["error"].startswith("job 1:")
    first = httpx.post(f"{url}{BATCH_PATH}", json=batch, headers=auth).json()
    again = httpx.post(f"{url}{BATCH_PATH}", json=batch, headers=auth).json()
    assert first["results"] == again["results"] and first["results"][0]["stdout"] == "7\n"
    assert (first["replayed"], again["replayed"]) == (False, True)
    assert service.metrics.replayed._value.get() == 1  # the retry did not run it again
    other = {"id": "b1", "jobs": [{"code": ECHO, "stdin": "8\n"}]}
    assert httpx.post(f"{url}{BATCH_PATH}", json=other, headers=auth).status_code == 409
    with HttpSandbox(urls=[url], token="s3cret") as sb:
        assert [r.stdout for r in sb.run_many(ECHO, ["1\n", "2\n"])] == ["1\n", "2\n"]


SLOW = "import time; time.sleep(1.5); print(input())\n"


def test_results_stream_back_as_their_jobs_finish(local_service):
    # One worker: the echo runs first, and its result comes while the slow job runs.
    jobs = [Job(code=ECHO, stdin="fast\n"), Job(code=SLOW, stdin="slow\n")]
    with HttpSandbox(urls=[local_service[1]], token="s3cret", batch_size=2) as sb:
        arrivals = [(i, r.stdout, time.perf_counter()) for i, r in sb.stream(jobs)]
    assert [(i, out) for i, out, _ in arrivals] == [(0, "fast\n"), (1, "slow\n")]
    assert arrivals[1][2] - arrivals[0][2] > 1.0


def test_compact_framing_names_each_program_once():
    jobs = [Job(code=ECHO, stdin=f"{i}\n") for i in range(3)] + [Job(code="pass", timeout_s=1.5)]
    body = encode_batch("b7", jobs)
    sent = json.loads(body)
    assert sent["programs"] == [ECHO, "pass"]
    assert sent["jobs"][0] == {"program": 0, "stdin": "0\n"}  # no default limits
    assert sent["jobs"][3] == {"program": 1, "timeout_s": 1.5}
    assert parse_batch(body) == ("b7", jobs)
    sent["jobs"][1]["program"] = 2
    with pytest.raises(RequestError, match="job 1: 'program' 2 is not one of the 2 programs"):
        parse_batch(json.dumps(sent).encode())


def test_a_client_gone_mid_stream_gets_the_whole_run_on_its_retry(local_service):
    service, url = local_service
    jobs = [Job(code=ECHO, stdin="a\n"), Job(code=SLOW, stdin="b\n"), Job(code=ECHO, stdin="c\n")]
    body = encode_batch("gone", jobs)
    headers = {"Authorization": "Bearer s3cret", "Accept": STREAM_TYPE}
    ran = service.metrics.jobs.labels(OK)._value.get()
    with httpx.stream("POST", f"{url}{BATCH_PATH}", content=body, headers=headers) as reply:
        assert reply.headers[REPLAYED_HEADER] == "0"
        first = parse_result_line(next(reply.iter_lines()))
    assert first[0] == 0 and first[1].stdout == "a\n"  # then the client hangs up
    again = httpx.post(f"{url}{BATCH_PATH}", content=body, headers=headers, timeout=30)
    assert again.headers[REPLAYED_HEADER] == "1"
    pairs = sorted(parse_result_line(line) for line in again.text.splitlines())
    assert [(i, r.stdout) for i, r in pairs] == [(0, "a\n"), (1, "b\n"), (2, "c\n")]
    assert service.metrics.jobs.labels(OK)._value.get() == ran + 3  # each job ran once


def test_failover_between_two_urls_when_one_is_down(local_service):
    _, url = local_service
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused, nothing ran
    with HttpSandbox(urls=[dead, url], token="s3cret", batch_size=2) as sb:
        results = sb.run_many(ECHO, [f"{i}\n" for i in range(10)])
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]
    assert all(r.attempts == 1 for r in results) and sb.stats["failovers"] > 0


def test_serving_beyond_loopback_needs_a_token():
    with Sandbox(backend="process", workers=1) as sb, pytest.raises(ValueError, match="token"):
        make_server(SandboxService(sb), "0.0.0.0", free_port())
    env = {k: v for k, v in os.environ.items() if k != "RSTAR_SANDBOX_TOKEN"}
    cli = subprocess.run(
        [str(BIN / "rstar"), "sandbox", "serve", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert cli.returncode != 0 and "without a token" in cli.stderr


def test_the_pipeline_resource_points_at_the_service(local_service, monkeypatch):
    _, url = local_service
    monkeypatch.delenv("RSTAR_SANDBOX_BACKEND", raising=False)
    monkeypatch.setenv("RSTAR_SANDBOX_URLS", url)
    monkeypatch.setenv("RSTAR_SANDBOX_TOKEN", "s3cret")
    assert SandboxResource().backend_name() == "http"
    result = dg.materialize([sums], resources={"sandbox": SandboxResource()})
    [event] = result.get_asset_materialization_events()
    assert event.materialization.metadata["outputs"].value == ["3", "7"]
