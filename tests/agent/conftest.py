from __future__ import annotations

import pytest

from rstar_sandbox import Sandbox
from tests.sandbox.conftest import require_backend


@pytest.fixture(scope="module")
def sandbox():
    """The real sandbox; tool calls and graded programs run in it."""
    require_backend("process")
    with Sandbox(backend="process", workers=2) as sb:
        yield sb


class CountingSandbox:
    """A sandbox that records the jobs of every `run` call."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.batches: list[list] = []

    def run(self, jobs):
        self.batches.append(list(jobs))
        return self.sandbox.run(jobs)


@pytest.fixture
def counting_sandbox(sandbox) -> CountingSandbox:
    return CountingSandbox(sandbox)
