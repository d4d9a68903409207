"""The training process end to end, as Dagster launches it: a subprocess with a JSON config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rstar_pipelines.llm.value_model import ProcessPreferenceModel
from rstar_pipelines.math.steps import TAGS
from tests.training.test_ppm import separable_pairs


def run_training(tmp_path: Path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, "-m", "rstar_pipelines.training.run", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def ppm_config(tmp_path: Path, base: str, data: Path) -> dict:
    return {
        "job": "ppm",
        "base_model": base,
        "data": str(data),
        "output_dir": str(tmp_path / "ppm"),
        "train": {"lr": 3e-3, "epochs": 2, "batch_size": 4, "heldout_fraction": 0.2},
        "num_threads": 1,
    }


def test_ppm_job_writes_checkpoint_and_metrics(tiny_base, tmp_path):
    data = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(separable_pairs(10)), data)
    result = run_training(tmp_path, ppm_config(tmp_path, tiny_base, data))
    assert result.returncode == 0, result.stderr
    assert "PPM step 4/4" in result.stderr  # progress, logged to stderr outside Dagster

    metrics = json.loads((tmp_path / "ppm" / "training_metrics.json").read_text())
    assert metrics["job"] == "ppm" and metrics["base_model"] == tiny_base
    assert metrics["steps"] == len(metrics["losses"]) == 4
    assert (metrics["train_pairs"], metrics["heldout_pairs"]) == (8, 2)
    assert metrics["train"]["lr"] == 3e-3
    ppm = ProcessPreferenceModel.load(tmp_path / "ppm")
    assert ppm.tokenizer.convert_tokens_to_ids(TAGS[0]) in ppm.tokenizer.all_special_ids
    assert len(ppm.raw_scores(["What is 1 + 1?"], ["x = 2"])) == 1


def test_bad_input_exits_naming_the_problem(tiny_base, tmp_path):
    data = tmp_path / "pairs.parquet"
    rows = [{k: v for k, v in pair.items() if k != "neg_count"} for pair in separable_pairs(2)]
    pq.write_table(pa.Table.from_pylist(rows), data)
    result = run_training(tmp_path, ppm_config(tmp_path, tiny_base, data))
    assert result.returncode == 2
    assert "lacks the column(s) neg_count" in result.stderr

    result = run_training(tmp_path, ppm_config(tmp_path, tiny_base, tmp_path / "absent.parquet"))
    assert result.returncode == 2
    assert "data file not found" in result.stderr

    config = ppm_config(tmp_path, tiny_base, data) | {"train": {"learning_rate": 1.0}}
    result = run_training(tmp_path, config)
    assert result.returncode == 2
    assert "learning_rate" in result.stderr
    assert not (tmp_path / "ppm").exists()
