from __future__ import annotations

import pytest

from rstar_sandbox import Sandbox
from tests.fakes.sandbox import CountingSandbox, require_backend


@pytest.fixture(scope="module")
def sandbox():
    """The real sandbox; tool calls and graded programs run in it."""
    require_backend("process")
    with Sandbox(backend="process", workers=2) as sb:
        yield sb


@pytest.fixture
def counting_sandbox(sandbox) -> CountingSandbox:
    return CountingSandbox(sandbox)
