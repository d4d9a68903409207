"""The one launcher of every training job: `python -m rstar_pipelines.training.launch CONFIG.json`.

It reads CONFIG.json and the data file (see `run`) and refuses bad input, a bad launch
configuration included, with exit status 2 and the problem named, before any model loads. Then it
starts `accelerate launch` with the job's launch configuration (`LaunchConfig`), which runs
`python -m rstar_pipelines.training.run CONFIG.json` in every process, and waits for it.

The ranks write their progress lines to stdout; launched by Dagster Pipes, the launcher relays
each line to the run's logs (one Pipes session for the whole job), otherwise to stderr. Their
stderr (warnings, tracebacks) passes through. A SIGTERM or SIGINT (Dagster cancelling the run)
is passed on to the whole process group of `accelerate launch`, and `accelerate launch` gets a
SIGTERM when the launcher dies, so no rank outlives the job.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dagster_pipes import PipesContext, open_dagster_pipes

from rstar_pipelines import settings
from rstar_pipelines.training import devices
from rstar_pipelines.training.config import TRL_ACCELERATE_CONFIGS, LaunchConfig
from rstar_pipelines.training.run import BadInput, RunConfig, read_config, read_rows


def accelerate_config_file(launch: LaunchConfig) -> Path | None:
    """The accelerate config file the launch names (TRL's by name, else a path), or None."""
    name = launch.accelerate_config
    if name is None:
        return None
    if name in TRL_ACCELERATE_CONFIGS:
        from importlib.util import find_spec

        spec = find_spec("trl")
        if spec is None or spec.origin is None:
            raise BadInput(f"accelerate_config {name!r} is one of TRL's, and TRL is not installed")
        return Path(spec.origin).parent / "accelerate_configs" / f"{name}.yaml"
    return settings.resolve_data_path(name)


def check_launch(config: RunConfig, train_settings: Any) -> None:
    """Refuse a launch configuration this machine or this job cannot run, naming why."""
    launch = config.launch
    if config.job == "gate":
        unsupported = {
            "processes": launch.processes != 1,
            "mixed_precision": launch.mixed_precision != "no",
            "accelerate_config": launch.accelerate_config is not None,
            "lora": launch.lora is not None,
            "gradient_accumulation_steps": launch.gradient_accumulation_steps != 1,
        }
        named = [name for name, set_ in unsupported.items() if set_]
        if named:
            raise BadInput(
                "the gate job distils with its own loop (rstar_kernels.distill) in one float32 "
                f"process: its launch cannot set {', '.join(named)}"
            )
    gpus = devices.cuda_devices()
    if launch.mixed_precision == "fp16" and not gpus:
        raise BadInput(
            "mixed_precision fp16 needs a CUDA GPU and this machine has none: use bf16 or no"
        )
    if gpus and launch.accelerate_config is None and launch.processes > gpus:
        raise BadInput(
            f"launch.processes is {launch.processes} but this machine has {gpus} GPU(s): one "
            "process per GPU (several machines take an accelerate_config)"
        )
    path = accelerate_config_file(launch)
    if path is not None:
        if not path.is_file():
            raise BadInput(f"accelerate_config file not found: {path}")
        text = path.read_text()
        if "DEEPSPEED" in text and _missing("deepspeed"):
            raise BadInput(
                f"{path} asks for DeepSpeed, which is not installed (pip install deepspeed)"
            )
        if ("DEEPSPEED" in text or "FSDP" in text) and not gpus:
            raise BadInput(
                f"{path} sets up DeepSpeed or FSDP, which need GPUs; this machine has none"
            )
    if launch.lora is not None and _missing("peft"):
        raise BadInput("launch.lora needs peft, which is not installed")
    if config.job == "grpo":
        from rstar_pipelines.training.grpo import check_batches

        try:
            check_batches(train_settings, launch)
        except ValueError as error:
            raise BadInput(str(error)) from error


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _missing(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is None


def accelerate_command(config_path: Path, config: RunConfig) -> list[str]:
    """The `accelerate launch` command line that runs the job's processes."""
    launch = config.launch
    command = [sys.executable, "-m", "accelerate.commands.launch", "--quiet"]
    path = accelerate_config_file(launch)
    if path is not None:
        command += ["--config_file", str(path)]
    elif launch.processes > 1:
        # torchrun starts the processes; without a GPU each one is a gloo rank on the CPU.
        # Its rendezvous gets a free port: on the default one, two jobs on one host would
        # meet in one store and wait for each other's ranks.
        command += ["--multi_gpu", "--num_machines", "1", "--main_process_port", str(_free_port())]
    else:
        command += ["--num_machines", "1"]
    command += [
        "--num_processes",
        str(launch.processes),
        "--mixed_precision",
        launch.mixed_precision,
        "--dynamo_backend",
        "no",
    ]
    threads = config.num_threads
    if threads is None and path is None:
        # Untold, accelerate runs each process with OMP_NUM_THREADS=1: one core of the
        # machine's, and a CPU training job half as fast as it could be on two.
        threads = max(1, len(os.sched_getaffinity(0)) // launch.processes)
    if threads is not None:
        command += ["--num_cpu_threads_per_process", str(threads)]
    return [*command, "-m", "rstar_pipelines.training.run", str(config_path)]


def launch(config_path: Path, log: Callable[[str], Any]) -> int:
    """Check the job, run it under `accelerate launch`; returns the exit status."""
    config, train_settings = read_config(config_path)
    read_rows(config)
    check_launch(config, train_settings)
    command = accelerate_command(config_path, config)
    log(
        f"launching the {config.job} job: {config.launch.processes} process(es), "
        f"mixed precision {config.launch.mixed_precision}"
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        # The job's own data and models only: nothing phones home, nothing is fetched.
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_terminate_with_parent,
    )

    def forward(signum: int, frame: Any) -> None:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for line in process.stdout:
            log(line.rstrip("\n"))
        status = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if status != 0:
        log(f"training failed: accelerate launch exited with status {status}")
    return status


def _terminate_with_parent() -> None:
    """In the child, before it runs: a SIGTERM when the launcher dies, however it dies (a
    SIGKILL leaves no time to pass a signal on); accelerate then stops its processes."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _logger(pipes: Any) -> Callable[[str], Any]:
    if isinstance(pipes, PipesContext):
        return pipes.log.info
    # Outside Dagster, open_dagster_pipes returns a mock that drops everything.
    return lambda message: print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rstar_pipelines.training.launch CONFIG.json", file=sys.stderr)
        return 2
    try:
        with open_dagster_pipes() as pipes:
            return launch(Path(args[0]), _logger(pipes))
    except BadInput as error:
        print(f"training: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
