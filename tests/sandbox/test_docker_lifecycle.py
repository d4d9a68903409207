"""Containers never outlive their pool: not after an exception, not after Ctrl-C."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rstar_sandbox import Job, Sandbox
from rstar_sandbox.pool import docker_client
from rstar_sandbox.workers import OWNER_LABEL
from tests.fakes.sandbox import require_backend


@pytest.fixture(autouse=True)
def _docker():
    require_backend("docker")


def _containers_of(pid: int) -> list:
    owner = f"{socket.gethostname()}:{pid}"
    return docker_client().containers.list(all=True, filters={"label": f"{OWNER_LABEL}={owner}"})


def test_containers_are_locked_down_and_removed_after_an_exception():
    with (
        pytest.raises(RuntimeError, match="user code failed"),
        Sandbox(backend="docker", workers=2) as sb,
    ):
        containers = _containers_of(os.getpid())
        assert len(containers) == 2
        config = containers[0].attrs["HostConfig"]
        assert config["NetworkMode"] == "none"
        assert config["ReadonlyRootfs"] is True
        assert config["CapDrop"] == ["ALL"]
        assert sorted(config["CapAdd"]) == ["SETGID", "SETUID"]  # to start jobs as their user
        assert "no-new-privileges" in config["SecurityOpt"]
        assert config["PidsLimit"] > 0 and config["Memory"] > 0 and config["NanoCpus"] > 0
        assert {"/tmp", "/dev/shm"} <= set(config["Tmpfs"])
        assert config["Sysctls"]["kernel.shmmni"] == "0"
        [up] = sb.run([Job(code="import os\nprint(os.getuid(), os.getgid(), os.getgroups())")])
        uid, gid, groups = up.stdout.split(maxsplit=2)
        assert uid == gid and int(uid) >= 10001 and groups.strip() == "[]"
        raise RuntimeError("user code failed")
    assert _containers_of(os.getpid()) == []


# Ctrl-C as a terminal sends it: SIGINT with Python's own handler, even where this test runs
# in the background of a shell, whose children inherit SIGINT ignored.
SLEEPING_POOL = (
    "import signal, time\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "from rstar_sandbox import Sandbox\n"
    "with Sandbox(backend='docker', workers=2) as sb:\n"
    "    print('ready', flush=True)\n"
    "    time.sleep(120)\n"
)


def _start_pool_process() -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLEEPING_POOL], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    assert len(_containers_of(proc.pid)) == 2
    return proc


def test_ctrl_c_removes_the_containers():
    proc = _start_pool_process()
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while _containers_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _containers_of(proc.pid) == []


def test_containers_of_a_killed_pool_are_removed_by_the_next_one():
    proc = _start_pool_process()
    proc.kill()  # SIGKILL: the pool cannot clean up after itself
    proc.wait()
    assert len(_containers_of(proc.pid)) == 2
    with Sandbox(backend="docker", workers=1):
        assert _containers_of(proc.pid) == []


def test_auto_picks_docker_only_when_the_image_is_built():
    assert Sandbox(backend="auto").backend == "docker"
    assert Sandbox(backend="auto", image="rstar-sandbox:never-built").backend == "process"
