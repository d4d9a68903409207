from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fakes.repo import REPO, RSTAR, SHARED_DATA

# Without a GPU, Triton kernels run in its interpreter. Triton reads this when triton.language
# is first imported (its standard-library functions become interpreted ones then), and other
# packages may import it early, so it is set here, before any test module is collected.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """Every test writes its data and Dagster instance under its own temporary dir."""
    data = tmp_path / "data"
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("RSTAR_DATA_DIR", str(data))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return data


@pytest.fixture
def incoming(isolated_dirs) -> Path:
    path = isolated_dirs / "seeds" / "incoming"
    path.mkdir(parents=True)
    return path


@pytest.fixture
def math500() -> Path:
    path = SHARED_DATA / "math500_test.json"
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing in CI")
        pytest.skip(f"{path} not present (it lives in ../shared/data beside the checkout)")
    return path


DEMO_TIMEOUT_S = 3600


@dataclass(frozen=True)
class DemoRun:
    """What `rstar demo` left: its Dagster home, its data directory and its console."""

    home: Path
    data: Path
    returncode: int
    output: str

    @property
    def event_log(self) -> Path:
        """The file the demo says Dagster's full event log went to."""
        prefix = "Dagster's full event log: "
        line = next(line for line in self.output.splitlines() if line.startswith(prefix))
        return Path(line.removeprefix(prefix))

    def use(self, monkeypatch) -> None:
        """Point this test's Dagster instance and data directory at the demo's."""
        monkeypatch.setenv("DAGSTER_HOME", str(self.home))
        monkeypatch.setenv("RSTAR_DATA_DIR", str(self.data))


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> DemoRun:
    """`rstar demo` end to end, once per session (about 10 minutes on a 2-core CPU,
    docs/benchmarks.md): the embedded model and the real sandbox through the whole declared
    graph. The demo's checks and the browser test of the UI share it."""
    root = tmp_path_factory.mktemp("demo")
    home, data = root / "dagster_home", root / "data"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "RSTAR_DATA_DIR": str(data)}
    proc = subprocess.run(
        [RSTAR, "demo"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
    )
    return DemoRun(home, data, proc.returncode, proc.stdout + proc.stderr)


# -- a tiny random Llama with the embedded model's real tokenizer (and chat template) --


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """SmolLM2's tokenizer (the model loads with it, about 20 s, once). Do not change it."""
    from rstar_pipelines.llm.transformers_backend import load_model_and_tokenizer

    return load_model_and_tokenizer("embedded")[1]


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, embedded_tokenizer) -> str:
    """Directory of a randomly initialised 2-layer Llama and the real tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = embedded_tokenizer
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that share the demo (tests/test_demo.py) first: `make test` runs xdist
    workers with --dist loadfile, so one worker computes the demo from the start while the
    others work through the rest, instead of the demo starting last with the others idle.
    The demo is the longest path: the rest keep their order, short modules among the long
    ones, which slow it less than the long ones together (docs/benchmarks.md)."""
    shares_demo = [item for item in items if "demo" in getattr(item, "fixturenames", ())]
    for item in shares_demo:  # the first of them computes the demo, up to its own limit
        item.add_marker(pytest.mark.timeout(DEMO_TIMEOUT_S + 300))
    items[:] = shares_demo + [item for item in items if item not in shares_demo]
