"""`rstar serve --dry-run`: the vllm serve command and environment for a sparse server, and the
refusals that come before anything starts (vLLM itself cannot run here)."""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner

from rstar_kernels.gate import GateConfig, SeerGates
from rstar_pipelines.cli import main

CONFIG = {"family": "llama", "num_layers": 2, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64}


@pytest.fixture
def gates(tmp_path):
    return str(SeerGates(GateConfig(**CONFIG, rope_theta=1e4, gate_dim=16)).save(tmp_path / "g"))


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 512, "model_type": "llama"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def serve(*args, env=None):
    return CliRunner().invoke(main, ["serve", "--dry-run", *args], env=env or {})


def printed(result):
    """The server's environment and command, and the pipeline's exports, as printed."""
    lines = result.output.splitlines()
    server = shlex.split(lines[lines.index("# the server:") + 1])
    start = server.index("vllm")
    env, command = dict(w.split("=", 1) for w in server[:start]), server[start:]
    exports = dict(
        shlex.split(line.removeprefix("export "))[0].split("=", 1)
        for line in lines
        if line.startswith("export ")
    )
    return env, command, exports


def test_dry_run_builds_the_command_and_environment(gates, model_dir):
    result = serve(model_dir, "--gates", gates, "--port", "8123", "--", "--max-num-seqs", "512")
    assert result.exit_code == 0, result.output
    env, command, exports = printed(result)
    name = exports["RSTAR_LLM_MODEL"]
    utilization = command[command.index("--gpu-memory-utilization") + 1]
    assert command == [
        "vllm", "serve", model_dir, "--host", "127.0.0.1", "--port", "8123",
        "--attention-backend", "CUSTOM", "--block-size", "64",
        "--served-model-name", name, "--gpu-memory-utilization", utilization,
        "--max-num-seqs", "512",
    ]  # fmt: skip
    # Graphs, and vLLM's default 0.92 lowered by the gate keys (fp32 [H_kv, 16] per page
    # against bf16 [64, H_kv, 2·64]: 2·16·4 + 1 bytes per 32 KiB of cache).
    assert "# mode: CUDA graphs" in result.output
    assert float(utilization) == pytest.approx(0.92 / (1 + 129 / 32768), abs=1e-4)
    assert "gate keys 0.39% of the KV cache" in result.output
    assert env == {
        "RSTAR_GATE_CHECKPOINT": gates,
        "RSTAR_SEER_KERNEL": "triton",
        "RSTAR_SEER_TOKEN_BUDGET": "4096",
    }
    assert exports["RSTAR_LLM_BACKEND"] == "openai"
    assert exports["RSTAR_LLM_BASE_URL"] == "http://127.0.0.1:8123/v1"
    # The sparse settings are in the served name, so the item cache keeps them apart.
    assert name == f"{model_dir}+seer(budget=4096,gates={gates})"


def test_memory_is_set_aside_from_the_utilization_asked_for(gates, model_dir):
    from rstar_kernels.gate import GateConfig as Config
    from rstar_kernels.vllm_layout import Selection, plugin_memory
    from rstar_pipelines.llm.serve import serve_plan

    config = Config(**CONFIG, rope_theta=1e4, gate_dim=16)
    memory = plugin_memory(config, Selection(4096, None), max_num_seqs=8)
    # Gathered keys and values of 66 pages of 64 tokens, bf16; 0 + 8 + 8 pages compressed, fp32.
    assert memory.scratch_bytes == 2 * 8 * 2 * 66 * 64 * 64 * 2 + 16 * 64 * 2 * 64 * 4 * 3
    args = ["--gpu-memory-utilization=0.8", "--max-num-seqs", "8", "--enforce-eager"]
    plan = serve_plan(model_dir, gates, vllm_args=args, gpu_memory_bytes=2**30)
    utilization = float(plan.command[plan.command.index("--gpu-memory-utilization") + 1])
    expected = 0.8 / (1 + memory.gate_keys_fraction) - memory.scratch_bytes / 2**30
    assert utilization == pytest.approx(expected, abs=1e-4)
    assert plan.command.count("--gpu-memory-utilization") == 1 and "0.8" not in plan.command
    assert plan.notes[0] == "mode: eager (--enforce-eager)" and "set aside" in plan.notes[2]
    with pytest.raises(ValueError, match="lower --max-num-seqs"):
        serve_plan(model_dir, gates, vllm_args=["--max-num-seqs", "4096"], gpu_memory_bytes=2**30)


def test_threshold_kernel_and_an_allow_list_of_plugins(gates, model_dir):
    result = serve(
        model_dir, "--gates", gates, "--threshold", "0.01", "--kernel", "tilelang",
        env={"VLLM_PLUGINS": "other"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    env, _, exports = printed(result)
    assert env["RSTAR_SEER_THRESHOLD"] == "0.01" and "RSTAR_SEER_TOKEN_BUDGET" not in env
    assert env["RSTAR_SEER_KERNEL"] == "tilelang"
    assert env["VLLM_PLUGINS"] == "other,rstar_seer"  # vLLM loads only what it names
    assert "threshold=0.01" in exports["RSTAR_LLM_MODEL"]


def test_an_fp8_cache_is_served_densely_with_a_warning(gates, model_dir):
    result = serve(model_dir, "--gates", gates, "--", "--kv-cache-dtype", "fp8")
    assert result.exit_code == 0
    assert "fp8 cache, so every layer decodes densely" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gates", "{tmp}/nowhere"], "not a directory written by SeerGates.save"),
        (["--gates", "{gates}", "--token-budget", "64", "--threshold", "0.1"], "not both"),
        (["--gates", "{gates}", "--threshold", "1.5"], "sparse_threshold must be in"),
        (["--gates", "{gates}", "--token-budget", "-1"], "non-negative"),
        (["--gates", "{gates}", "--kernel", "torch"], "--kernel must be one of triton"),
        (["--gates", "{gates}", "--port", "0"], "--port must be in"),
        (["--gates", "{gates}", "--", "--tensor-parallel-size", "2"], "tensor parallelism 1"),
        (["--gates", "{gates}", "--", "-tp=4"], "tensor parallelism 1"),
        (["--gates", "{gates}", "--", "--block-size", "16"], "--block-size is set by rstar"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(args, message, gates, model_dir, tmp_path):
    args = [a.format(gates=gates, tmp=tmp_path) for a in args]
    result = serve(model_dir, *args)
    assert result.exit_code != 0
    assert message in result.output
    assert "# the server:" not in result.output


def test_gates_of_another_model_are_refused(tmp_path, model_dir):
    other = SeerGates(GateConfig(**{**CONFIG, "num_kv_heads": 4}, rope_theta=1e4, gate_dim=16))
    result = serve(model_dir, "--gates", str(other.save(tmp_path / "other")))
    assert result.exit_code != 0
    assert "num_key_value_heads: model 2, gates 4" in result.output


def test_gate_blocks_vllm_cannot_page_are_refused(tmp_path, model_dir):
    odd = SeerGates(GateConfig(**CONFIG, rope_theta=1e4, gate_dim=16, block_size=24))
    result = serve(model_dir, "--gates", str(odd.save(tmp_path / "odd")))
    assert result.exit_code != 0
    assert "multiple of 16 tokens" in result.output


def test_without_vllm_installed_the_command_says_how_to_get_it(gates, model_dir):
    result = CliRunner().invoke(main, ["serve", model_dir, "--gates", gates], env={"PATH": ""})
    assert result.exit_code != 0
    assert "pip install 'rstar-pipelines[gpu]'" in result.output
