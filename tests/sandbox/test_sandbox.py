"""The sandbox against hostile and ordinary programs, for both backends."""

import os
import socket
import threading
import time
import uuid

import pytest

from rstar_sandbox import (
    MEMORY_LIMIT,
    OK,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    TIMEOUT,
    Job,
    Sandbox,
)
from rstar_sandbox.server import needs_preloaded
from tests.fakes.repo import host_processes_matching
from tests.fakes.sandbox import has_lean_zygote

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_ordinary_outcomes(sandbox):
    results = sandbox.run(
        [
            Job(code=ADD, stdin="1 2\n"),
            Job(code="print('unclosed'"),
            Job(code="raise ValueError('boom')"),
            Job(code="import sys\nprint('bye')\nsys.exit(3)"),
        ]
    )
    ok, syntax, exception, exit3 = results
    assert (ok.status, ok.exit_code, ok.stdout) == (OK, 0, "3\n")
    assert ok.wall_s > 0 and ok.cpu_s >= 0 and ok.peak_memory_mb > 0
    assert syntax.status == RUNTIME_ERROR and "SyntaxError" in syntax.stderr
    assert 'File "main.py", line 1' in syntax.stderr and "server.py" not in syntax.stderr
    assert exception.status == RUNTIME_ERROR and exception.stderr.rstrip().endswith(
        "ValueError: boom"
    )
    assert (exit3.status, exit3.exit_code, exit3.stdout) == (RUNTIME_ERROR, 3, "bye\n")


@pytest.mark.parametrize(
    ("source", "preloaded"),
    [
        ("print(1)", False),
        ("import sys, os.path as p\nfrom collections import deque\n", False),
        ("from __future__ import annotations\nimport math  # not numpy\n", False),
        ("x = 'import numpy'\n", False),
        ("import os, numpy as np\n", True),
        ("def f():\n    from numpy.linalg import inv\n", True),
        ("import scipy.optimize\n", True),  # not the standard library: it may import numpy
        ('"""\nimport numpy\n"""\n', True),  # a docstring: the scan errs on the safe side
    ],
)
def test_which_jobs_go_to_the_zygote_that_preloaded_numpy(source, preloaded):
    assert needs_preloaded(source, frozenset({"numpy"})) is preloaded


def test_jobs_find_numpy_preloaded_only_where_they_import_it(sandbox):
    check = "import sys\nprint('numpy' in sys.modules)\n"
    lean, preloaded, dynamic = sandbox.run(
        [
            Job(code=check),
            Job(code=check + "import numpy\n"),
            Job(code=check + "print(__import__('numpy').arange(4).sum())\n"),  # unseen: slower
        ]
    )
    in_lean = str(not has_lean_zygote(sandbox.backend))
    assert (lean.status, lean.stdout) == (OK, f"{in_lean}\n")
    assert (preloaded.status, preloaded.stdout) == (OK, "True\n")
    assert (dynamic.status, dynamic.stdout) == (OK, f"{in_lean}\n6\n")


def test_run_many_keeps_input_order(sandbox):
    outputs = sandbox.run_many(ADD, [f"{i} {i}\n" for i in range(20)], timeout_s=2.0)
    assert [r.stdout for r in outputs] == [f"{2 * i}\n" for i in range(20)]


def test_stream_gives_each_result_once_as_its_job_finishes(sandbox):
    slow = Job(code="import time; time.sleep(1)\n" + ADD, stdin="0 0\n", timeout_s=5.0)
    jobs = [slow, *(Job(code=ADD, stdin=f"{i} {i}\n", timeout_s=2.0) for i in range(1, 20))]
    pairs = list(sandbox.stream(jobs))
    assert sorted(i for i, _ in pairs) == list(range(20))
    assert pairs[-1][0] == 0  # the slow job, taken first, ends last
    assert all(r.stdout == f"{2 * i}\n" for i, r in pairs)


def test_infinite_loop_times_out_and_leaves_nothing(sandbox):
    marker = f"sleep {4000 + os.getpid() % 1000}.{uuid.uuid4().int % 1000}"
    code = f"import subprocess\nsubprocess.Popen({marker.split()!r})\nwhile True:\n    pass\n"
    started = time.monotonic()
    [result] = sandbox.run([Job(code=code, timeout_s=1.0)])
    assert result.status == TIMEOUT
    assert time.monotonic() - started < 1.0 + 1.0
    assert host_processes_matching(marker) == []


def test_orphaned_grandchild_in_its_own_session_is_killed(sandbox):
    marker = f"sleep {5000 + os.getpid() % 1000}.{uuid.uuid4().int % 1000}"
    code = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execvp('sleep', {marker.split()!r})\n"
        "print('parent exits at once')\n"
    )
    [result] = sandbox.run([Job(code=code, timeout_s=5.0)])
    assert result.status == OK and result.stdout == "parent exits at once\n"
    assert host_processes_matching(marker) == []


def test_fork_bomb_is_contained_and_the_pool_keeps_serving(sandbox):
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    [result] = sandbox.run([Job(code=bomb, timeout_s=2.0)])
    assert result.status == TIMEOUT
    after = sandbox.run_many(ADD, ["2 2\n"] * 10, timeout_s=5.0)
    assert all(r.status == OK and r.stdout == "4\n" for r in after)


def test_memory_and_output_limits(sandbox):
    big_alloc, flood = sandbox.run(
        [
            Job(code="x = bytearray(4 * 1024**3)", memory_mb=256),
            Job(
                code="import sys\nfor _ in range(1600):\n    sys.stdout.write('x' * 65536)\n",
                output_limit_bytes=1 << 20,
                timeout_s=10.0,
            ),
        ]
    )
    assert big_alloc.status == MEMORY_LIMIT and "MemoryError" in big_alloc.stderr
    assert flood.status == OUTPUT_LIMIT
    assert len(flood.stdout) == 1 << 20


def test_no_network_even_to_the_hosts_loopback(sandbox):
    accepted = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    listener = threading.Thread(target=accept)
    listener.start()
    code = (
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "print('connected')"
    )
    [result] = sandbox.run([Job(code=code, timeout_s=5.0)])
    listener.join()
    server.close()
    assert result.status == RUNTIME_ERROR and "connected" not in result.stdout
    assert accepted == []


def test_host_environment_and_files_are_not_visible(backend, tmp_path, monkeypatch):
    secret = f"rstar-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RSTAR_TEST_SECRET", secret)
    host_file = f"/tmp/{secret}"
    with open(host_file, "w") as fh:
        fh.write(secret)
    try:
        with Sandbox(backend=backend, workers=1) as sb:
            env, files, write = sb.run(
                [
                    Job(code="import os\nprint(sorted(os.environ.items()))"),
                    Job(
                        code=f"import os\nprint(os.path.exists({host_file!r}), os.listdir('/tmp'))"
                    ),
                    Job(code="open('/usr/local/rstar-escape', 'w').write('x')"),
                ]
            )
    finally:
        os.unlink(host_file)
    assert env.status == OK and secret not in env.stdout and "RSTAR_TEST_SECRET" not in env.stdout
    assert files.stdout == "False []\n"
    assert write.status == RUNTIME_ERROR
    assert "Read-only file system" in write.stderr or "Permission denied" in write.stderr
    assert not os.path.exists("/usr/local/rstar-escape")


def test_scratch_state_does_not_leak_between_jobs(sandbox):
    first, second = sandbox.run(
        [
            Job(code="open('left-behind', 'w').write('x')\nimport builtins\nbuiltins.leak = 1"),
            Job(code="import os, builtins\nprint(os.listdir('.'), hasattr(builtins, 'leak'))"),
        ]
    )
    assert first.status == OK
    assert second.stdout == "[] False\n"


def test_killed_worker_mid_batch_loses_and_duplicates_nothing(backend):
    with Sandbox(backend=backend, workers=2) as sb:
        jobs = [
            Job(code=f"import time\ntime.sleep(0.05)\nprint({i})", timeout_s=5.0) for i in range(60)
        ]
        results = []
        runner = threading.Thread(target=lambda: results.extend(sb.run(jobs)))
        runner.start()
        time.sleep(0.6)
        sb.kill_worker(0)
        runner.join(timeout=120)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(60)]
    assert all(r.status == OK for r in results)
    assert any(r.attempts == 2 for r in results)  # the job in flight was retried


def test_two_thousand_jobs_from_sixteen_threads(sandbox):
    per_thread = 125
    outcomes: dict[int, list] = {}

    def client(t: int) -> None:
        stdins = [f"{t} {i}\n" for i in range(per_thread)]
        outcomes[t] = sandbox.run_many(ADD, stdins, timeout_s=10.0)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert sorted(outcomes) == list(range(16))
    for t, results in outcomes.items():
        assert [r.stdout for r in results] == [f"{t + i}\n" for i in range(per_thread)]
        assert all(r.status == OK and r.attempts == 1 for r in results)
