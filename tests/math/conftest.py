import pytest

from rstar_sandbox import Sandbox


@pytest.fixture(scope="module")
def sandbox():
    """The process backend: the search tests are about the rules, not the isolation."""
    with Sandbox(backend="process", workers=2) as sb:
        yield sb
