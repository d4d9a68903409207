"""`rstar serve`: a `vllm serve` command that decodes with SeerAttention-R's sparse attention.

`serve_plan` checks everything it can before anything starts (the gates directory, the selection
rule, the block size, the model's heads against the gates', the vLLM arguments passed through)
and returns the command, the environment vLLM's workers read (`rstar_kernels.vllm_plugin`) and
the RSTAR_LLM_* settings that point the pipeline's openai backend at the server. The served model
name carries the sparse settings, so completions cached from a dense server are not reused.

The server runs with CUDA graphs unless `--enforce-eager` is passed through: the sparse decode
step reads nothing back on the host and has shapes fixed by the batch size, so vLLM captures
full graphs of pure decode steps and runs mixed steps piecewise. vLLM's memory profile does not
see the backend's gate keys and decode scratch (`rstar_kernels.vllm_layout.plugin_memory`), so
`rstar serve` lowers `--gpu-memory-utilization` by them and prints the figures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .sparse import SeerSettings

# FlashAttention's kernel block sizes are multiples of 16 (vLLM 0.32.0,
# vllm/v1/attention/backends/flash_attn.py line 365), and the page size is the gates' block.
BLOCK_MULTIPLE = 16
# vLLM options that `rstar serve` sets itself, or that the sparse backend cannot run with.
OWN_OPTIONS = ("--attention-backend", "--block-size", "--served-model-name", "--host", "--port")
TP_OPTIONS = ("--tensor-parallel-size", "-tp")
# vLLM 0.32.0's default (vllm/config/cache.py line 102), lowered by the backend's memory.
GPU_MEMORY_UTILIZATION = 0.92
# The batch the decode scratch is sized for, passed as --max-num-seqs unless one is given.
MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class ServePlan:
    command: list[str]
    env: dict[str, str]  # what is set on top of the caller's environment
    settings: dict[str, str]  # RSTAR_LLM_* for the pipeline
    warnings: list[str]
    notes: list[str]  # how the server runs: graphs or eager, the memory set aside


def serve_plan(
    model: str,
    gates: str,
    *,
    token_budget: int | None = None,
    threshold: float | None = None,
    kernel: str = "triton",
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    vllm_args: Sequence[str] = (),
    environ: Mapping[str, str] = os.environ,
    gpu_memory_bytes: int | None = None,
) -> ServePlan:
    """The `vllm serve` command for `model` with the gates in `gates`; ValueError or
    FileNotFoundError naming what is wrong. `gpu_memory_bytes` (the GPU's, when known) lets the
    decode scratch be set aside too, not only the gate keys."""
    from rstar_kernels.gate import WEIGHTS_FILE
    from rstar_kernels.vllm_layout import Selection
    from rstar_kernels.vllm_plugin import (
        BUDGET_ENV,
        GATE_ENV,
        KERNEL_ENV,
        PLUGIN_NAME,
        THRESHOLD_ENV,
        VLLM_KERNELS,
        load_gate_config,
    )

    seer = SeerSettings.from_options("seer", gates, token_budget, threshold)
    config = load_gate_config(seer.gate_checkpoint)
    if not (Path(seer.gate_checkpoint) / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{gates} holds no {WEIGHTS_FILE}: not a SeerGates directory")
    if kernel not in VLLM_KERNELS:
        raise ValueError(f"--kernel must be one of {', '.join(VLLM_KERNELS)}, not {kernel!r}")
    if config.block_size % BLOCK_MULTIPLE:
        raise ValueError(
            f"the gates' block size is {config.block_size}; vLLM's FlashAttention pages must be "
            f"a multiple of {BLOCK_MULTIPLE} tokens, so these gates cannot serve in vLLM"
        )
    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, not {port}")
    _check_model(model, config, seer.gate_checkpoint)
    warnings = _check_vllm_args(vllm_args)
    selection = Selection(seer.token_budget, seer.threshold, kernel)
    memory_args, notes = _memory_args(config, selection, vllm_args, gpu_memory_bytes)
    eager = "--enforce-eager" in vllm_args
    notes.insert(
        0,
        "mode: eager (--enforce-eager)"
        if eager
        else "mode: CUDA graphs (full graphs of pure decode steps, sparse attention inside; "
        "mixed steps piecewise)",
    )

    name = served_model_name or model + seer.tag
    command = ["vllm", "serve", model, "--host", host, "--port", str(port)]
    command += ["--attention-backend", "CUSTOM", "--block-size", str(config.block_size)]
    command += ["--served-model-name", name, *memory_args]
    env = {GATE_ENV: seer.gate_checkpoint, KERNEL_ENV: kernel}
    if seer.threshold is not None:
        env[THRESHOLD_ENV] = str(seer.threshold)
    else:
        env[BUDGET_ENV] = str(seer.token_budget)
    plugins = environ.get("VLLM_PLUGINS")
    if plugins is not None and PLUGIN_NAME not in plugins.split(","):
        # vLLM loads only the plugins VLLM_PLUGINS names, when it is set.
        env["VLLM_PLUGINS"] = ",".join([p for p in plugins.split(",") if p] + [PLUGIN_NAME])
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    settings = {
        "RSTAR_LLM_BACKEND": "openai",
        "RSTAR_LLM_BASE_URL": f"http://{shown_host}:{port}/v1",
        "RSTAR_LLM_MODEL": name,
    }
    return ServePlan(command, env, settings, warnings, notes)


def _option(args: Sequence[str], option: str) -> tuple[str | None, list[str]]:
    """The value of `option` in `args` (`--x v` or `--x=v`) and the args without it."""
    rest, value, skip = [], None, False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == option and i + 1 < len(args):
            value, skip = args[i + 1], True
        elif arg.startswith(option + "="):
            value = arg.partition("=")[2]
        else:
            rest.append(arg)
    return value, rest


def _memory_args(
    config, selection, vllm_args: Sequence[str], gpu_memory_bytes: int | None
) -> tuple[list[str], list[str]]:
    """The vLLM args with --max-num-seqs and a --gpu-memory-utilization lowered by the sparse
    backend's memory, and the lines that say what was set aside."""
    from rstar_kernels.vllm_layout import plugin_memory

    utilization, args = _option(vllm_args, "--gpu-memory-utilization")
    seqs, _ = _option(args, "--max-num-seqs")
    try:
        asked = float(utilization) if utilization else GPU_MEMORY_UTILIZATION
        max_num_seqs = int(seqs) if seqs else MAX_NUM_SEQS
    except ValueError as err:
        raise ValueError(f"--gpu-memory-utilization/--max-num-seqs: {err}") from None
    if not 0 < asked <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], not {asked}")
    memory = plugin_memory(config, selection, max_num_seqs)
    lowered = memory.utilization(asked, gpu_memory_bytes)
    notes = [
        f"memory: gate keys {memory.gate_keys_fraction:.2%} of the KV cache; "
        f"--gpu-memory-utilization {asked:g} -> {lowered:.4f}"
    ]
    if memory.scratch_bytes is None:
        notes.append("memory: a threshold's decode scratch grows with the context; not set aside")
    else:
        where = "set aside" if gpu_memory_bytes else "not set aside (the GPU's size is unknown)"
        notes.append(
            f"memory: decode scratch {memory.scratch_bytes / 2**20:.0f} MiB per layer step at "
            f"--max-num-seqs {max_num_seqs}, {where}"
        )
    extra = [] if seqs else ["--max-num-seqs", str(max_num_seqs)]
    return ["--gpu-memory-utilization", f"{lowered:.4f}", *extra, *args], notes


def _check_model(model: str, config, gates: str) -> None:
    """The model's attention heads against the gates' (for a local model directory)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return  # a hub id: vLLM's workers compare the heads when they build each layer
    model_config = json.loads(path.read_text())
    heads = model_config.get("num_attention_heads")
    expected = {
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
    }
    found = {
        "num_hidden_layers": model_config.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": model_config.get("num_key_value_heads", heads),
        "head_dim": model_config.get("head_dim")
        or (model_config.get("hidden_size", 0) // heads if heads else None),
    }
    wrong = [f"{k}: model {found[k]}, gates {v}" for k, v in expected.items() if found[k] != v]
    if wrong:
        raise ValueError(f"the gates in {gates} are not for {model} ({'; '.join(wrong)})")


def _check_vllm_args(args: Sequence[str]) -> list[str]:
    warnings = []
    for i, arg in enumerate(args):
        option, _, inline = arg.partition("=")
        value = inline or (args[i + 1] if i + 1 < len(args) else "")
        if option in OWN_OPTIONS:
            raise ValueError(f"{option} is set by rstar serve (see its --help); leave it out")
        if option in TP_OPTIONS and value != "1":
            raise ValueError(
                f"{option} {value}: the SeerAttention-R backend runs with tensor parallelism 1 "
                "(its gates hold every KV head of a layer); serve more replicas instead"
            )
        if option == "--kv-cache-dtype" and value.startswith("fp8"):
            warnings.append(
                f"--kv-cache-dtype {value}: the gates cannot read an fp8 cache, so every layer "
                "decodes densely"
            )
    return warnings
