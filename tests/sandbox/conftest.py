import os

import pytest

from rstar_sandbox import Sandbox, docker_available


def require_backend(backend: str) -> None:
    """Docker tests run wherever an engine answers, and must run in CI."""
    if backend == "docker" and not docker_available():
        if os.environ.get("CI"):
            pytest.fail("CI must run the Docker sandbox tests, but no Docker engine answers")
        pytest.skip("no Docker engine answers here")
    if backend == "process" and os.geteuid() != 0 and not os.path.exists("/proc/self/ns/user"):
        pytest.skip("the process backend needs root or user namespaces")


def has_lean_zygote(backend: str) -> bool:
    """Whether a worker runs stdlib-only jobs in a zygote without numpy: where its jobs
    run as a uid of their own (Docker; the process backend when started as root)."""
    return backend == "docker" or os.geteuid() == 0


@pytest.fixture(scope="module", params=["docker", "process"])
def backend(request) -> str:
    require_backend(request.param)
    return request.param


@pytest.fixture(scope="module")
def sandbox(backend):
    with Sandbox(backend=backend, workers=2) as sb:
        yield sb
