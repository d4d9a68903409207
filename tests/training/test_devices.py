"""`mixed_precision: auto`: bfloat16 autocast only where the job's devices multiply bfloat16
natively (GPUs of compute capability 8.0 or newer, else a CPU with AVX512-BF16 or AMX), resolved
before the job's fingerprint so checkpoints of either precision never share a directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from rstar_kernels import cpu_features
from rstar_pipelines.training import devices, stages
from rstar_pipelines.training.config import LaunchConfig
from rstar_pipelines.training.run import read_config

AVX2 = frozenset({"avx2", "fma"})
AVX512_BF16 = frozenset({"avx512f", "avx512_bf16"})
AMX = frozenset({"avx512f", "amx_tile", "amx_bf16"})


def machine(monkeypatch, cpu: frozenset[str], gpus: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: cpu)
    monkeypatch.setattr(devices, "cuda_compute_capabilities", lambda: gpus)


@pytest.mark.parametrize(
    ("cpu", "gpus", "precision"),
    [
        (AVX2, [], "no"),
        (AVX512_BF16, [], "bf16"),
        (AMX, [], "bf16"),
        (AVX2, [(8, 0), (9, 0)], "bf16"),  # the GPUs train, whatever the CPU
        (AMX, [(7, 0)], "no"),  # a V100 emulates bfloat16
        (AVX2, [(8, 6), (7, 5)], "no"),  # every GPU must have it
    ],
)
def test_auto_is_bf16_only_where_the_devices_multiply_it_natively(
    monkeypatch, cpu, gpus, precision
):
    machine(monkeypatch, cpu, gpus)
    launch = LaunchConfig(mixed_precision="auto")
    assert devices.resolved(launch, "sft").mixed_precision == precision
    # The gate job distils in float32 only: auto is float32 for it on every machine.
    assert devices.resolved(launch, "gate").mixed_precision == "no"


@pytest.mark.parametrize("declared", ["no", "bf16", "fp16"])
def test_a_declared_precision_is_kept_as_declared(monkeypatch, declared):
    machine(monkeypatch, AVX2, [])
    launch = LaunchConfig(mixed_precision=declared, processes=2)
    assert devices.resolved(launch, "ppm") == launch


def test_compute_capabilities_are_read_from_nvidia_smi_for_the_visible_gpus(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --list-gpus ]; then printf "GPU 0: A\\nGPU 1: B\\n"; exit 0; fi\n'
        '[ "$1 $2" = "--query-gpu=compute_cap --format=csv,noheader" ] || exit 9\n'
        'printf "8.0\\n7.5\\n"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.cuda_devices() == 2
    assert devices.cuda_compute_capabilities() == [(8, 0), (7, 5)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert devices.cuda_devices() == 1
    assert devices.cuda_compute_capabilities() == [(7, 5)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f2c")
    assert devices.cuda_compute_capabilities() == [(8, 0)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.cuda_compute_capabilities() == []


def test_without_nvidia_smi_there_are_no_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert devices.cuda_devices() == 0 and devices.cuda_compute_capabilities() == []


def test_the_training_process_reads_auto_as_this_machines_precision(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "job": "sft",
                "base_model": "embedded",
                "data": str(tmp_path / "data.parquet"),
                "output_dir": str(tmp_path / "out"),
                "launch": {"mixed_precision": "auto"},
            }
        )
    )
    for cpu, precision in ((AVX2, "no"), (AMX, "bf16")):
        machine(monkeypatch, cpu, [])
        assert read_config(config)[0].launch.mixed_precision == precision


def test_checkpoints_trained_in_either_precision_never_share_a_job_directory(monkeypatch):
    """The SFT stage up to its job's directory, on two machines: two directories."""

    def directory(root: Path, name: str):
        raise Launched(name)

    monkeypatch.setattr(stages, "job_directory", directory)
    monkeypatch.setattr(stages, "_local_model", lambda ctx, model: "embedded")
    params = stages.PolicyTrainingParams(model="policy", launch={"mixed_precision": "auto"})
    data = {"sft_dataset": pa.table({"messages": [[{"role": "user", "content": "hi"}]]})}
    names = []
    for cpu in (AVX2, AMX, AVX2):
        machine(monkeypatch, cpu, [])
        with pytest.raises(Launched) as launched:
            stages.PolicyCheckpoint(params).run(None, data)
        names.append(launched.value.args[0])
    assert names[0] != names[1] and names[0] == names[2]


class Launched(Exception):
    """What the stage's job directory raises instead of opening: the job's name."""
