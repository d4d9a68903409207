import pytest

from rstar_sandbox import Sandbox
from tests.fakes.sandbox import require_backend


@pytest.fixture(scope="module", params=["docker", "process"])
def backend(request) -> str:
    require_backend(request.param)
    return request.param


@pytest.fixture(scope="module")
def sandbox(backend):
    with Sandbox(backend=backend, workers=2) as sb:
        yield sb
