"""Shared fixtures: the embedded model loaded once, and a real `transformers serve` on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rstar_pipelines.llm import export_embedded_model, load_llm
from tests.fakes.servers import free_port, stop

SERVER_READY_TIMEOUT_S = 180


@pytest.fixture(scope="session")
def embedded_llm():
    """The embedded SmolLM2 model in process, as it runs by default on a CPU (int4 weights);
    loaded once (the first GGUF conversion takes 20-60 s, then about a second), then cached."""
    return load_llm("transformers", "embedded", batch_size=4)


@pytest.fixture(scope="session")
def embedded_fp32_llm():
    """The embedded model with its float32 weights as transformers dequantizes them."""
    return load_llm("transformers", "embedded", batch_size=4, quantization="none")


@pytest.fixture(scope="session")
def embedded_plain_llm():
    """The embedded model with the CPU speed-ups off: transformers' generate() on its float32
    weights."""
    return load_llm("transformers", "embedded", batch_size=4, cpu_speedups=False)


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory, embedded_plain_llm):
    # Depends on the plain model so the export reuses the model already in memory.
    return export_embedded_model(tmp_path_factory.mktemp("smollm2-hf"))


def start_transformers_server(model_dir, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`transformers serve` on a free loopback port, in its own process group (so a test can
    stop it and anything it started), once it answers; returns the process and its base URL."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_until_ready(server, base_url, log_path)
    except BaseException:
        stop(server, timeout_s=15)
        raise
    return server, base_url


@pytest.fixture
def start_server(served_model_dir, tmp_path):
    """Starts more `transformers serve` processes of the exported model for one test (each
    returned as (process, base URL)); they are stopped at its end."""
    started = []

    def start() -> tuple[subprocess.Popen, str]:
        started.append(
            start_transformers_server(served_model_dir, tmp_path / f"serve-{len(started)}.log")
        )
        return started[-1]

    yield start
    for server, _ in started:
        stop(server, timeout_s=15)


@pytest.fixture(scope="session")
def transformers_server(served_model_dir, tmp_path_factory):
    """Base URL (…/v1) of `transformers serve` running the exported model; stopped at the end."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    server, base_url = start_transformers_server(served_model_dir, log_path)
    try:
        yield base_url
    finally:
        stop(server, timeout_s=15)


def _wait_until_ready(server: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log = log_path.read_text()[-3000:]
            raise RuntimeError(f"transformers serve exited with {server.returncode}:\n{log}")
        try:
            # /v1/models answers once the app is up; the pinned model is loaded before that.
            if httpx.get(f"{base_url}/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    log = log_path.read_text()[-3000:]
    raise RuntimeError(f"transformers serve not ready after {SERVER_READY_TIMEOUT_S} s:\n{log}")
