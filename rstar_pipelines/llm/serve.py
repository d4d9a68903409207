"""`rstar serve`: a `vllm serve` command that decodes with SeerAttention-R's sparse attention.

`serve_plan` checks everything it can before anything starts (the gates directory, the selection
rule, the block size, the model's heads against the gates', the vLLM arguments passed through)
and returns the command, the environment vLLM's workers read (`rstar_kernels.vllm_plugin`) and
the RSTAR_LLM_* settings that point the pipeline's openai backend at the server. The served model
name carries the sparse settings, so completions cached from a dense server are not reused.
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


@dataclass(frozen=True)
class ServePlan:
    command: list[str]
    env: dict[str, str]  # what is set on top of the caller's environment
    settings: dict[str, str]  # RSTAR_LLM_* for the pipeline
    warnings: list[str]


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
) -> ServePlan:
    """The `vllm serve` command for `model` with the gates in `gates`; ValueError or
    FileNotFoundError naming what is wrong."""
    from rstar_kernels.gate import WEIGHTS_FILE
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

    name = served_model_name or model + seer.tag
    command = ["vllm", "serve", model, "--host", host, "--port", str(port)]
    command += ["--attention-backend", "CUSTOM", "--block-size", str(config.block_size)]
    command += ["--enforce-eager", "--served-model-name", name, *vllm_args]
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
    return ServePlan(command, env, settings, warnings)


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
