"""The training launcher as Dagster runs it (a subprocess with a JSON config that starts
`accelerate launch`): two CPU processes over gloo train as one with twice the batch, a job killed
after its first checkpoint resumes when its asset is materialized again and ends where an
uninterrupted run ends, bad input and bad launch configurations are refused before any model
loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from rstar_kernels import cpu_features
from rstar_pipelines import settings
from rstar_pipelines.math.steps import TAGS
from rstar_pipelines.storage import query, schemas
from rstar_pipelines.storage.parquet_io import write_table
from rstar_pipelines.training.launch import accelerate_command
from rstar_pipelines.training.ppm import ProcessPreferenceModel
from rstar_pipelines.training.run import RunConfig
from tests.fakes.repo import REPO
from tests.fakes.training import launch, separable_pairs

# -- one SFT job, three ways: one process, two processes, killed and resumed ----------------

SFT_TRAIN = {"lr": 1e-2, "epochs": 6, "max_length": 64, "weight_decay": 0.0}
STEPS = 24  # 16 examples, 4 per step, 6 epochs


def sft_rows() -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + {i % 5}?"},
                {"role": "assistant", "content": f"<answer>{i + i % 5}</answer> " * (1 + i % 3)},
            ]
        }
        for i in range(16)
    ]


def sft_config(base: str, data: Path, out: Path, processes: int, batch: int) -> dict:
    return {
        "job": "sft",
        "base_model": base,
        "data": str(data),
        "output_dir": str(out),
        "train": {**SFT_TRAIN, "batch_size": batch},
        "launch": {"processes": processes, "save_steps": 4},
        "num_threads": 1,
    }


@pytest.fixture(scope="module")
def one_process(tiny_base, tmp_path_factory) -> dict:
    """The SFT job in one process with 4 examples a step: its metrics and checkpoint."""
    tmp = tmp_path_factory.mktemp("one-process")
    data = tmp / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(sft_rows()), data)
    result = launch(tmp, sft_config(tiny_base, data, tmp / "out", processes=1, batch=4))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp / "out" / "training_metrics.json").read_text())
    return {"metrics": metrics, "out": tmp / "out", "stdout": result.stderr}


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


@pytest.mark.slow
def test_two_cpu_processes_train_as_one_with_twice_the_batch(one_process, tiny_base, tmp_path):
    data = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(sft_rows()), data)
    result = launch(tmp_path, sft_config(tiny_base, data, tmp_path / "out", processes=2, batch=2))
    assert result.returncode == 0, result.stderr[-3000:]
    # Both ranks really train, and each says so.
    for rank in (0, 1):
        assert f"[rank {rank}/2] SFT step {STEPS}/{STEPS}: loss" in result.stderr
    metrics = json.loads((tmp_path / "out" / "training_metrics.json").read_text())
    single = one_process["metrics"]
    assert (metrics["processes"], single["processes"]) == (2, 1)
    assert metrics["cpu_threads"] == single["cpu_threads"] == 1  # as the config says
    assert metrics["steps"] == single["steps"] == STEPS
    # The same examples each step (2 per rank), the same token-mean loss: the same curve.
    assert metrics["losses"] == pytest.approx(single["losses"], rel=2e-3, abs=2e-3)
    assert single["losses"][-1] < 0.5 * single["losses"][0]
    two, one = weights(tmp_path / "out"), weights(one_process["out"])
    assert all(torch.allclose(two[k], one[k], atol=2e-3) for k in one)


def test_untold_the_processes_share_the_machines_cpus(tmp_path):
    """accelerate alone would run each CPU process on one thread (OMP_NUM_THREADS=1)."""
    cpus = len(os.sched_getaffinity(0))

    def threads(**fields) -> str:
        config = RunConfig(
            job="sft", base_model="base", data=tmp_path, output_dir=tmp_path, **fields
        )
        command = accelerate_command(tmp_path / "config.json", config)
        return command[command.index("--num_cpu_threads_per_process") + 1]

    assert threads() == str(cpus)
    assert threads(launch={"processes": 2}) == str(max(1, cpus // 2))
    assert threads(num_threads=3) == "3"


def test_a_multi_process_job_meets_its_ranks_on_a_free_port(tmp_path):
    """Not torchrun's default port 29500, where two jobs on one host would share a store."""
    config = RunConfig(
        job="sft", base_model="base", data=tmp_path, output_dir=tmp_path, launch={"processes": 2}
    )
    command = accelerate_command(tmp_path / "config.json", config)
    port = int(command[command.index("--main_process_port") + 1])
    assert port != 29500
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def _descendants(pid: int) -> list[int]:
    """The process ids under `pid` (the test's own subprocess), from ps."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the subprocess and everything it started, each by its id, and wait for them."""
    pids = [process.pid, *_descendants(process.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids[1:]):
        time.sleep(0.2)


MATERIALIZE = """
import sys
from pathlib import Path
import dagster as dg
from rstar_pipelines.definitions import build_definitions, load_spec
defs = build_definitions(load_spec(Path(sys.argv[1])))
with dg.instance_for_test() as instance:
    dg.materialize(list(defs.assets), selection=["policy_checkpoint"], instance=instance,
                   resources=dict(defs.resources))
"""


@pytest.mark.slow
def test_a_killed_job_resumes_when_materialized_again(one_process, tiny_base, tmp_path):
    text = (REPO / "assets" / "pipeline.yaml").read_text()
    declared = "      train: {lr: 1.0e-5, epochs: 1, batch_size: 4, max_length: 1024}\n"
    assert declared in text
    train = json.dumps({**SFT_TRAIN, "batch_size": 4})
    text = text.replace("  policy: null", f"  policy: {tiny_base}").replace(
        declared, f"      train: {train}\n      num_threads: 1\n"
    )
    declared_launch = "      launch: {processes: 1, mixed_precision: auto, save_steps: 50}\n"
    assert declared_launch in text
    # float32, as the uninterrupted run it is compared with, and a checkpoint every 4 steps.
    text = text.replace(declared_launch, "      launch: {processes: 1, save_steps: 4}\n", 1)
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(text)
    rows = [{"id": f"s{i}", "source": "mcts", **r} for i, r in enumerate(sft_rows())]
    table = pa.Table.from_pylist(rows, schema=schemas.SFT_DATASET)
    write_table(table, settings.lake_dir() / "sft_dataset.parquet")

    # The first materialization is killed, launcher and ranks with it, after its first checkpoint.
    output = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        [sys.executable, "-c", MATERIALIZE, str(spec)],
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    checkpoints = settings.data_dir() / "checkpoints" / "sft-r1"
    deadline = time.monotonic() + 600
    while not list(checkpoints.glob("*/checkpoint-*/trainer_state.json")):
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _kill_tree(first)
    [killed] = checkpoints.iterdir()
    assert not (killed / "training_metrics.json").exists()

    from rstar_pipelines.definitions import build_definitions, load_spec

    defs = build_definitions(load_spec(spec))
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            list(defs.assets),
            selection=["policy_checkpoint"],
            instance=instance,
            resources=dict(defs.resources),
        )
        assert result.success
    [row] = query("select * from policy_checkpoint").to_pylist()
    assert row["path"] == str(killed)  # the same job's directory, found again
    assert row["resumed_from_step"] >= 4 and row["resumed_from_step"] % 4 == 0
    assert row["steps"] == STEPS
    metrics = json.loads((killed / "training_metrics.json").read_text())
    # The step count and the optimizer state went on: the run ends where an uninterrupted one
    # (the same job in one process, above) ends.
    single = one_process["metrics"]
    assert metrics["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-5)
    resumed, uninterrupted = weights(killed), weights(one_process["out"])
    assert all(torch.allclose(resumed[k], uninterrupted[k], atol=1e-5) for k in uninterrupted)
    assert not list(killed.glob("checkpoint-*"))


# -- the PPM job, and what is refused -------------------------------------------------------


def ppm_config(tmp_path: Path, base: str, data: Path, **launch_settings) -> dict:
    return {
        "job": "ppm",
        "base_model": base,
        "data": str(data),
        "output_dir": str(tmp_path / "ppm"),
        "train": {"lr": 3e-3, "epochs": 2, "batch_size": 4, "heldout_fraction": 0.2},
        "launch": launch_settings,
        "num_threads": 1,
    }


@pytest.mark.slow
def test_ppm_job_writes_checkpoint_and_metrics(tiny_base, tmp_path):
    data = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(separable_pairs(10)), data)
    result = launch(tmp_path, ppm_config(tmp_path, tiny_base, data, mixed_precision="auto"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PPM step 4/4: loss" in result.stderr  # progress, relayed to stderr outside Dagster
    # auto, resolved for this CPU by the launcher and the rank alike (tests/training/test_devices).
    precision = "bf16" if cpu_features.native_bfloat16() else "no"
    assert f"mixed precision {precision}" in result.stderr

    metrics = json.loads((tmp_path / "ppm" / "training_metrics.json").read_text())
    assert metrics["job"] == "ppm" and metrics["base_model"] == tiny_base
    assert metrics["steps"] == len(metrics["losses"]) == 4
    assert (metrics["train_pairs"], metrics["heldout_pairs"]) == (8, 2)
    assert metrics["train"]["lr"] == 3e-3 and metrics["launch"]["processes"] == 1
    assert metrics["launch"]["mixed_precision"] == precision
    ppm = ProcessPreferenceModel.load(tmp_path / "ppm")
    assert ppm.tokenizer.convert_tokens_to_ids(TAGS[0]) in ppm.tokenizer.all_special_ids
    assert len(ppm.raw_scores(["What is 1 + 1?"], ["x = 2"])) == 1


@pytest.mark.slow
def test_bad_input_and_bad_launch_configs_exit_2_naming_the_problem(tiny_base, tmp_path):
    data = tmp_path / "pairs.parquet"
    rows = [{k: v for k, v in pair.items() if k != "neg_count"} for pair in separable_pairs(2)]
    pq.write_table(pa.Table.from_pylist(rows), data)

    def refused(config: dict, message: str) -> None:
        result = launch(tmp_path, config)
        assert result.returncode == 2, result.stderr[-2000:]
        assert message in result.stderr
        assert "launching" not in result.stderr  # refused before accelerate or a model starts

    refused(ppm_config(tmp_path, tiny_base, data), "lacks the column(s) neg_count")
    refused(ppm_config(tmp_path, tiny_base, tmp_path / "absent.parquet"), "data file not found")
    config = ppm_config(tmp_path, tiny_base, data) | {"train": {"learning_rate": 1.0}}
    refused(config, "learning_rate")

    pq.write_table(pa.Table.from_pylist(separable_pairs(2)), data)
    if not torch.cuda.is_available():
        refused(ppm_config(tmp_path, tiny_base, data, mixed_precision="fp16"), "fp16 needs a CUDA")
    refused(ppm_config(tmp_path, tiny_base, data, processes=0), "launch.processes")
    refused(ppm_config(tmp_path, tiny_base, data, accelerate_config="zero9"), "one of TRL's")
    missing = str(tmp_path / "absent.yaml")
    refused(ppm_config(tmp_path, tiny_base, data, accelerate_config=missing), "file not found")
    refused(ppm_config(tmp_path, tiny_base, data, lora={"rank": 4}), "lora.rank")
    gate = ppm_config(tmp_path, tiny_base, data, processes=2) | {"job": "gate", "train": {}}
    gate["data"] = str(tmp_path / "texts.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "some text"}]), gate["data"])
    refused(gate, "its launch cannot set processes")
    assert not (tmp_path / "ppm").exists()


def test_job_directory_finds_a_killed_job_and_never_reuses_a_finished_one(tmp_path):
    from rstar_pipelines.training.run import METRICS_FILE
    from rstar_pipelines.training.stages import job_directory

    with job_directory(tmp_path, "job") as first:
        assert first.name == "job"
        with job_directory(tmp_path, "job") as concurrent:  # the first is locked: another one
            assert concurrent.name == "job-2"
    with job_directory(tmp_path, "job") as again:  # not finished (killed, say): found again
        assert again == first
        (again / METRICS_FILE).write_text("{}")
    with job_directory(tmp_path, "job") as after:  # finished: never written again
        assert after.name == "job-2"
