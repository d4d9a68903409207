"""Training jobs as the assets start them, and data a PPM learns at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rstar_pipelines.math.steps import STEP_END


def launch(tmp_path: Path, config: dict, name: str = "config.json") -> subprocess.CompletedProcess:
    """The training launcher on `config` (written to `tmp_path / name`), as Dagster runs it."""
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, "-m", "rstar_pipelines.training.launch", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def separable_pairs(count: int) -> list[dict]:
    """Chosen steps end with a step tag, rejected ones with an error: easy to tell apart."""
    return [
        {
            "prompt": f"What is {i} + {i}?",
            "chosen": f"x = {i} + {i}\nprint(x){STEP_END}",
            "rejected": f"x = {i} - {i}\nNameError",
            "pos_count": 2,
            "neg_count": 1 + i % 2,
        }
        for i in range(count)
    ]
