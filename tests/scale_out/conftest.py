import pytest

from tests.fakes import servers


@pytest.fixture(scope="session")
def postgres_url():
    with servers.postgres() as url:
        yield url


@pytest.fixture(scope="session")
def redis_url():
    with servers.redis() as url:
        yield url
